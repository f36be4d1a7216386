"""`KnightsTask`: a seeded knights-and-knaves puzzle as a single-turn task."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.base import Problem, SingleTurnTask
from tasks.knights.puzzle import MAX_PEOPLE, Puzzle, make_puzzle, render
from tasks.knights.verify import grade

SYSTEM = (
    "Solve the logic puzzle. Every inhabitant of the island is either a knight, who always tells the "
    "truth, or a knave, who always lies. Reason step by step, then end with your conclusion, one line "
    "per person, e.g. 'Alice is a knight.' or 'Bob is a knave.'"
)


@dataclass(frozen=True)
class KnightsTask(SingleTurnTask):
    people: int = 3  # inhabitants in the puzzle, 2..8; each makes one statement
    name: str = "kk"

    def __post_init__(self):
        if isinstance(self.people, bool) or not isinstance(self.people, int) or not 2 <= self.people <= MAX_PEOPLE:
            raise ValueError(f"kk people must be an integer 2..{MAX_PEOPLE} (the puzzle size), got {self.people!r}")

    def generate(self, seed: int) -> Problem:
        puzzle = make_puzzle(random.Random(seed), self.people)
        answer = ",".join(f"{n}={'knight' if k else 'knave'}" for n, k in zip(puzzle.names, puzzle.knights))
        return Problem(seed=seed, messages=(("system", SYSTEM), ("user", puzzle_text(puzzle))), answer=answer)

    def reward(self, problem: Problem, completion: str) -> float:
        return grade(completion, problem.answer)


def puzzle_text(puzzle: Puzzle) -> str:
    names = puzzle.names
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    lines = [
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, "
        "and knaves always lie.",
        f"You meet {len(names)} inhabitants: {listed}.",
    ]
    lines += [f'{n} says: "{render(s, i, names)}"' for i, (n, s) in enumerate(zip(names, puzzle.statements))]
    lines.append("Who is a knight and who is a knave?")
    return "\n".join(lines)

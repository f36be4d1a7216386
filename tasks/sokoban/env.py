"""Multi-turn Sokoban: the model pushes boxes onto goals a few moves per turn.

Each turn the model replies with moves; the episode applies them and answers with the new board.

Reading a reply (never raises; same text, same moves):
- only the first `MAX_REPLY_CHARS` characters are read;
- if they contain `<answer>...</answer>` blocks, only the text inside the last one counts;
- moves are the words up, down, left, right (any case, whole words) in order; if that text holds no
  such word but consists only of the letters U, D, L, R (any case) with spaces or commas, as in
  "URRD" or "u, r, r", each letter is a move. Letters are not read out of prose, where "I" or "a
  U-turn" would otherwise turn into moves;
- at most `max_moves_per_turn` moves are applied; the rest are ignored and the observation says so.
A move into a wall, or into a box with a wall or box behind it, changes nothing and counts as invalid.

Score (what trains), of the board as it stands, however it got there:

    score = 1.0                                        if every box is on a goal
          = 0.5 * max(0, 1 - distance / distance_0)    otherwise

where `distance` sums, over boxes, the Manhattan distance to the nearest goal, and `distance_0` is
that of the start (never 0: no box starts on a goal). So doing nothing scores 0, every push that
brings a box nearer a goal earns a share of the 0.5 (a small model rarely solves a level at first,
and reward only for solving would give GRPO groups that all tie), pushing a box onto a goal and off
again earns nothing, and only a solve reaches 1. Each Step's `reward` is the change in score over
that turn (for logs). `done` is True only once solved; the driver stops after `max_turns` turns.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tasks.base import MAX_REPLY_CHARS, Episode, Step, Task
from tasks.sokoban.generate import generate
from tasks.sokoban.level import LEGEND, WORDS, Level

PARTIAL_WEIGHT = 0.5  # all of an unsolved board's boxes on goals would still score below a solve

SYSTEM = (
    "You are playing Sokoban. Push every box onto a goal.\n"
    "Symbols: {legend}. The board is drawn row by row, top row first.\n"
    "Rules: you move one square up, down, left or right. Walking into a box pushes it one square, "
    "but only if the square beyond it is free (floor or goal). You cannot pull a box, push two boxes "
    "at once, or walk through walls. A box pushed into a corner can never be moved out again.\n"
    "Reply format: think briefly, then give your moves inside answer tags, for example "
    "<answer>up, left, left</answer>. Each turn, up to {moves} moves are applied in order; after each "
    "turn you see the new board. You have {turns} turn{s}."
)
NO_MOVES = "No moves found. Reply with moves such as: <answer>up, left, left</answer>"

_TAG = re.compile(r"<(/?)answer>", re.IGNORECASE)
_WORD = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)
_LETTERS = re.compile(r"[UDLR\s,]+", re.IGNORECASE)
_FIRST_LETTER = {"u": "U", "d": "D", "l": "L", "r": "R"}


@dataclass(frozen=True)
class SokobanTask(Task):
    size: int = 6  # board side, outer wall ring included
    boxes: int = 2
    max_turns: int = 5  # model turns per episode
    max_moves_per_turn: int = 10
    min_solution: int = 2  # fewest box pushes a generated level needs (the solver is push-optimal)
    name: str = "sokoban"

    def __post_init__(self):
        if not 5 <= self.size <= 10:
            raise ValueError(f"sokoban size must be 5..10 (the board side, walls included), "
                             f"got {self.size}")
        most = min(4, self.size - 3)  # more boxes than this leave too little room to move them
        if not 1 <= self.boxes <= most:
            raise ValueError(f"sokoban boxes must be 1..{most} on a {self.size}x{self.size} board (at "
                             f"most size - 3, at most 4), got {self.boxes}; use fewer boxes or a larger size")
        if not 1 <= self.max_turns <= 20:
            raise ValueError(f"sokoban max_turns must be 1..20, got {self.max_turns}")
        if not 1 <= self.max_moves_per_turn <= 50:
            raise ValueError(f"sokoban max_moves_per_turn must be 1..50, got {self.max_moves_per_turn}")
        budget = self.max_turns * self.max_moves_per_turn
        if not 1 <= self.min_solution <= min(20, budget):
            raise ValueError(f"sokoban min_solution (box pushes) must be 1..{min(20, budget)}: at most 20 and "
                             f"at most max_turns * max_moves_per_turn = {budget} moves, got {self.min_solution}")

    def episode(self, seed: int) -> SokobanEpisode:
        level, solution = generate(random.Random(seed), self.size, self.boxes, self.min_solution,
                                   max_moves=self.max_turns * self.max_moves_per_turn)
        return SokobanEpisode(level, self.max_turns, self.max_moves_per_turn, solution)


class SokobanEpisode(Episode):
    def __init__(self, level: Level, max_turns: int, max_moves_per_turn: int, solution: str = ""):
        self.start = self.level = level
        self.max_turns, self.max_moves_per_turn = max_turns, max_moves_per_turn
        self.solution = solution  # one push-optimal solution in LURD letters; never shown to the model
        self.turns = 0
        system = SYSTEM.format(legend=LEGEND, moves=max_moves_per_turn, turns=max_turns,
                               s="" if max_turns == 1 else "s")
        user = f"{level.render()}\n\nBoxes on goals: {level.on_goals}/{len(level.boxes)}. Your move."
        self.messages = (("system", system), ("user", user))

    def step(self, action: str) -> Step:
        if self.level.solved:
            return Step(observation="The puzzle is already solved.", reward=0.0, done=True)
        before = self.score()
        self.turns += 1
        moves, extra = parse_moves(action, self.max_moves_per_turn)
        applied, invalid = 0, 0
        for letter in moves:
            if self.level.solved:  # stop: later moves could only push boxes back off their goals
                break
            moved = self.level.move(letter)
            applied += 1
            if moved is None:
                invalid += 1
            else:
                self.level = moved
        observation = self._observation(moves[:applied], invalid, extra)
        return Step(observation=observation, reward=self.score() - before, done=self.level.solved)

    def score(self) -> float:
        if self.level.solved:
            return 1.0
        return PARTIAL_WEIGHT * max(0.0, 1.0 - goal_distance(self.level) / goal_distance(self.start))

    def _observation(self, moves: str, invalid: int, extra: bool) -> str:
        if not moves:
            lines = [NO_MOVES]
        else:
            lines = [f"Moves: {', '.join(WORDS[m] for m in moves)}."]
            if invalid:
                lines.append(f"{invalid} move{' was' if invalid == 1 else 's were'} blocked (a wall, or a box "
                             f"that cannot move) and did nothing.")
            if extra:
                lines.append(f"Only the first {self.max_moves_per_turn} moves of a turn are applied; the rest "
                             f"were ignored.")
        boxes = f"Boxes on goals: {self.level.on_goals}/{len(self.level.boxes)}."
        lines += ["", self.level.render(), "", boxes]
        left = self.max_turns - self.turns
        if self.level.solved:
            lines.append("Solved! Every box is on a goal.")
        elif left <= 0:
            lines.append("No turns left.")
        else:
            lines.append("This is your last turn." if left == 1 else f"{left} turns left.")
        return "\n".join(lines)


def parse_moves(text: str, limit: int) -> tuple[str, bool]:
    """The first `limit` moves of a reply as LURD letters, and whether it held more (module doc)."""
    text = answer_text(text[:MAX_REPLY_CHARS])
    letters = []
    for match in _WORD.finditer(text):
        # .get: a case-insensitive match is plain ASCII here, but an unknown letter must never raise.
        if letter := _FIRST_LETTER.get(match.group(1)[:1].lower()):
            letters.append(letter)
        if len(letters) > limit:
            break
    if not letters and text.strip() and _LETTERS.fullmatch(text):
        letters = [_FIRST_LETTER[ch.lower()] for ch in text if ch.lower() in _FIRST_LETTER][: limit + 1]
    return "".join(letters[:limit]), len(letters) > limit


def answer_text(text: str) -> str:
    """The inside of the last complete <answer>...</answer> block, else all of `text`. One linear scan
    of the tags, so a reply of thousands of unclosed "<answer>" costs no more than any other."""
    opened, inside = None, None
    for tag in _TAG.finditer(text):
        if not tag.group(1):
            opened = tag.end()
        elif opened is not None:
            inside, opened = text[opened:tag.start()], None
    return text if inside is None else inside


def goal_distance(level: Level) -> int:
    """Sum over boxes of the Manhattan distance to the nearest goal: 0 exactly when solved."""
    return sum(min(abs(b[0] - g[0]) + abs(b[1] - g[1]) for g in level.goals) for b in level.boxes)

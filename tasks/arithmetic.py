"""Arithmetic word problems from a seed, scored on the final number (`tasks.answers`).

Difficulty knobs: `digits` (operand size), `terms` (numbers per problem) and `ops` (any of
"+-*"). The demo default, one-digit addition in short word problems, starts SmolLM2-135M-Instruct
in the 10-60 % reward band that GRPO learns from fastest (see docs/tasks.md for measurements).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.answers import is_correct
from tasks.base import Problem, SingleTurnTask

SYSTEM = "Solve the problem. End your reply with the final answer as a number."
TEMPLATES = (
    "What is {expr}?",
    "Compute {expr}.",
    "A box holds {a} red balls and {b} blue balls. How many balls are in the box? ({expr})",
    "Sam has {a} coins and finds {b} more. How many coins does Sam have now? ({expr})",
)


@dataclass(frozen=True)
class ArithmeticTask(SingleTurnTask):
    digits: int = 1
    terms: int = 2
    ops: str = "+"
    name: str = "arithmetic"

    def __post_init__(self):
        if not 1 <= self.digits <= 6:
            raise ValueError(f"arithmetic digits must be 1..6, got {self.digits}")
        if not 2 <= self.terms <= 5:
            raise ValueError(f"arithmetic terms must be 2..5, got {self.terms}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"arithmetic ops must be a non-empty mix of '+-*', got {self.ops!r}")

    def generate(self, seed: int) -> Problem:
        rng = random.Random(seed)
        hi = 10**self.digits - 1
        numbers = [rng.randint(1 if self.digits == 1 else 10 ** (self.digits - 1), hi) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        expr = " ".join(f"{n} {op}" for n, op in zip(numbers, ops)) + f" {numbers[-1]}"
        # Word templates only read naturally for two-term addition.
        templates = TEMPLATES if self.terms == 2 and ops == ["+"] else TEMPLATES[:2]
        text = rng.choice(templates).format(expr=expr, a=numbers[0], b=numbers[-1])
        answer = str(_evaluate(numbers, ops))
        return Problem(seed=seed, messages=(("system", SYSTEM), ("user", text)), answer=answer)

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if is_correct(completion, problem.answer) else 0.0


def _evaluate(numbers: list[int], ops: list[str]) -> int:
    """Left-to-right with * binding tighter, as written; no eval of any string."""
    terms, signs = [numbers[0]], []
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(op)
    total = terms[0]
    for sign, t in zip(signs, terms[1:]):
        total = total + t if sign == "+" else total - t
    return total

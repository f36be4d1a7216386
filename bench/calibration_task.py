"""A task a random model earns rewards on, for calibrating verification on tiny random models
(`bench/verification.py --task bench.calibration_task:LetterShare`).

On arithmetic a random model earns 0 every time, so every GRPO advantage is 0 and each version's
adapter stays at its initialization (B = 0): the LoRA matmuls run and add nothing. Here the
prompts are arithmetic's and the reward is the share of the reply's characters that are ASCII
letters, which a random model's samples differ in: the advantages are not 0 and each version's
adapter moves the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.arithmetic import ArithmeticTask
from tasks.base import Problem


@dataclass(frozen=True)
class LetterShare(ArithmeticTask):
    name: str = "letter-share"

    def reward(self, problem: Problem, completion: str) -> float:
        return sum(c.isascii() and c.isalpha() for c in completion) / len(completion) if completion else 0.0

"""`echo-coordinator` with one extra, test-only task registered, run as a real subprocess.

A tiny random model never solves arithmetic, so every GRPO group would tie and no gradient
would flow. The `letter_e` task rewards the share of 'e' characters in a completion: random
text varies in it, so groups have non-zero advantages and the adapter really moves each step.
"""

from dataclasses import dataclass

from tasks import Problem
from tasks.registry import TASKS


@dataclass(frozen=True)
class LetterETask:
    name: str = "letter_e"

    def generate(self, seed: int) -> Problem:
        return Problem(seed=seed, messages=(("user", f"Write something with many letters e. ({seed})"),), answer="")

    def reward(self, problem: Problem, completion: str) -> float:
        return completion.count("e") / (len(completion) + 1)


TASKS["letter_e"] = LetterETask

if __name__ == "__main__":
    from echo_coordinator.cli import main

    main()

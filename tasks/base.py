"""The interface every environment implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """One task instance. `messages` are chat turns (role, content) for the model's template."""

    seed: int
    messages: tuple[tuple[str, str], ...]
    answer: str


class Task(Protocol):
    name: str

    def generate(self, seed: int) -> Problem:
        """The same seed gives the same problem on every peer."""

    def reward(self, problem: Problem, completion: str) -> float:
        """Deterministic score in [0, 1] of a completion; never raises on any text."""

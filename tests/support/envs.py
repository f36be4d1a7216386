"""User-defined environments, as a run author would write them, loaded by dotted path
(`task = "tests.support.envs:LetterE"`) the way a run.toml names its own environment.

A tiny random model never solves a real task, so every GRPO group would tie and no gradient
would flow. These reward the share of letters 'e' in the model's text: random text varies in
it, so groups have non-zero advantages and the adapter really moves each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks import Episode, Problem, SingleTurnTask, Step, Task


def e_share(text: str) -> float:
    return text.count("e") / (len(text) + 1)


@dataclass(frozen=True)
class LetterE(SingleTurnTask):
    name: str = "letter_e"

    def generate(self, seed: int) -> Problem:
        return Problem(seed=seed, messages=(("user", f"Write something with many letters e. ({seed})"),), answer="")

    def reward(self, problem: Problem, completion: str) -> float:
        return e_share(completion)


@dataclass(frozen=True)
class MoreE(Task):
    """Multi-turn: after each reply the environment says how many e's it counted and asks for
    more; the episode ends early when a reply is at least half e's."""

    max_turns: int = 3
    name: str = "more_e"

    def episode(self, seed: int) -> Episode:
        return MoreEEpisode(seed)


class MoreEEpisode(Episode):
    def __init__(self, seed: int):
        self.messages = (("user", f"Write letters e. Round 1 of game {seed}."),)
        self.replies: list[str] = []

    def step(self, action: str) -> Step:
        before = self.score()
        self.replies.append(action)
        done = e_share(action) >= 0.5
        observation = f"I counted {action.count('e')} e's in {len(action)} characters. Round {len(self.replies) + 1}: more e!"
        return Step(observation, self.score() - before, done)

    def score(self) -> float:
        return e_share("".join(self.replies))

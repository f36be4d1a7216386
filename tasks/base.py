"""The environment API.

A `Task` is an environment family at one difficulty (its constructor parameters, validated
there). `task.episode(seed)` starts one play: the same seed gives the same episode on every peer.
An `Episode` opens with chat `messages`; the model answers, the episode `step`s on the model's
text and replies with an observation, until it is done or the task's `max_turns` model turns
are used; `score()` then grades the whole episode. Single-turn tasks subclass `SingleTurnTask`
and write only `generate` and `reward`.

Rewards are recomputed by the trainer, which replays the episode from the seed and the model's
turns; a node's claimed reward never counts. So everything here is deterministic in (parameters,
seed, model text), and no method may raise on any model text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

MAX_REPLY_CHARS = 20_000  # verifiers read no more of a reply: bounds regex work on runaway text
Message = tuple[str, str]  # (role, content) chat turn: role is "system", "user" or "assistant"


@dataclass(frozen=True)
class Step:
    observation: str  # the environment's reply, shown to the model as the next user turn
    reward: float  # this turn's shaped reward, for logs; the episode's `score()` is what trains
    done: bool  # the episode is over (solved, failed, or answered); no further turns


class Episode(ABC):
    messages: tuple[Message, ...]  # the opening chat turns

    @abstractmethod
    def step(self, action: str) -> Step:
        """Apply the model's reply. Never called again once a Step said `done`."""

    @abstractmethod
    def score(self) -> float:
        """The episode's reward in [0, 1], from everything played so far (an unfinished episode,
        cut by the turn limit, is scored as it stands)."""


class Task(ABC):
    name: str = ""
    max_turns: int = 1  # model turns per episode; 1 = single-turn

    @abstractmethod
    def episode(self, seed: int) -> Episode:
        """A fresh episode; the same seed gives the same episode on every peer."""


@dataclass(frozen=True)
class Problem:
    """One single-turn task instance."""

    seed: int
    messages: tuple[Message, ...]
    answer: str


class SingleTurnTask(Task):
    """A task answered in one reply: a generated `Problem` and a verifier."""

    @abstractmethod
    def generate(self, seed: int) -> Problem:
        """The same seed gives the same problem on every peer."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Deterministic score in [0, 1] of a completion; never raises on any text."""

    def episode(self, seed: int) -> Episode:
        return Answer(self, self.generate(seed))


class Answer(Episode):
    """The episode of a single-turn task: one reply, then done."""

    def __init__(self, task: SingleTurnTask, problem: Problem):
        self.task, self.problem, self.messages = task, problem, problem.messages
        self.completion: str | None = None

    def step(self, action: str) -> Step:
        self.completion = action
        return Step(observation="", reward=self.score(), done=True)

    def score(self) -> float:
        return 0.0 if self.completion is None else self.task.reward(self.problem, self.completion)

"""What a `RunService` is built from besides the manifest: the work it hands out, and how."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from echo_coordinator.evaluation import EvalSet
from engines.episodes import Transcripts
from tasks import Task


@dataclass(frozen=True)
class Work:
    """What nodes are asked to do, and how their answers are scored."""

    task: Task  # the run's task: its seeds are leased for training
    render_prompt: Callable[[int], tuple[int, ...]]  # training seed -> prompt token ids
    transcripts: Transcripts  # how a pushed episode is replayed for its reward
    evaluation: EvalSet | None = None  # held-out evaluation; None: the run is not evaluated
    eval_task: Task | None = None  # the run's task, maybe with other parameters; None: the run's own

    def task_of(self, evaluation: bool) -> Task:
        """The task a batch is scored with: evaluation answers with the evaluation task."""
        return (self.eval_task or self.task) if evaluation else self.task


@dataclass(frozen=True)
class LeaseSettings:
    """How work is handed out."""

    lease_seconds: float  # how long a lease is held before its seeds go to the next node that asks
    seeds_per_lease: int  # training seeds per lease (an evaluation lease: about as many completions)
    largest_lease: int = 64  # training seeds: a lease may grow to fill a node's batch up to this
    first_seed: int = 0  # async mode draws fresh seeds from here as leases drain them
    # Async: buffered groups at which no lease is issued until the trainer takes some (None =
    # no cap). Over-producing nodes would otherwise fill the buffer, and the trainer, taking
    # the oldest groups first, would train S versions behind all the time. Leases out do not
    # count, so a straggler holding one never stops the others.
    max_ahead: int | None = None
    # Async, for measuring learning under staleness only: training leases bind, and nodes are told
    # as the newest, the version `lag` before the trainer's (`protocols.sync.told_version`).
    lag: int = 0

    @property
    def first_lease_seconds(self) -> float:
        """A key that has not delivered lately holds one lease at a time, of this long: peers that
        never answer hold seeds only so long (`Leasing.lease`). A node's first lease is one prompt,
        a standard lease a quarter of a step, so a quarter of the standard time leaves it room."""
        return self.lease_seconds / 4

"""Held-out evaluation: how good the trained policy is, measured by the swarm.

Every `eval_every` versions (and at version 0 and the last) the coordinator opens an *evaluation
round* for version v: the run's fixed evaluation seeds, leased to nodes like rollouts but
answered at exactly version v, greedy and/or sampled at the run's temperature. The trainer
replays and scores every answer as it scores rollouts and verifies the sampling the same way
(greedy is Gumbel-max with zero noise), so a node cannot fake the accuracy any more than it can
fake a reward. Answers are never trained on and are credited to nodes separately (ledger table
`evaluations`).

Who answers: in sequential mode nodes are idle while the trainer steps, so evaluation leases go
to nodes that would otherwise wait; in async mode nodes are never idle by design, so evaluation
leases come first. Only a node that holds version v or older can answer (it moves forward to
v); one that has moved past v samples the newer policy and is given training work instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from protocols.leases import LeaseBook

EVAL_SEED_BASE = 10**12  # far from every training seed, the same set in every run of a task
SAMPLINGS = {"greedy": ("greedy",), "sampled": ("sampled",), "both": ("greedy", "sampled")}


def eval_seeds(prompts: int) -> tuple[int, ...]:
    return tuple(range(EVAL_SEED_BASE, EVAL_SEED_BASE + prompts))


def due(version: int, every: int, last: int) -> bool:
    """Is `version` evaluated: version 0, every `every`-th, and the run's last (`every` 0: none)."""
    return every > 0 and (version % every == 0 or version == last)


@dataclass(frozen=True)
class EvalSet:
    """What a run evaluates on: the prompts of its fixed seeds, and how they are answered."""

    prompts: dict[int, tuple[int, ...]]  # seed -> prompt token ids, rendered once
    samplings: tuple[str, ...]  # "greedy" and/or "sampled"
    samples: int  # completions per prompt when sampled (greedy: 1, all would be the same)

    @classmethod
    def of(cls, seeds: tuple[int, ...], render: Callable[[int], tuple[int, ...]], sampling: str, samples: int) -> EvalSet:
        return cls({seed: render(seed) for seed in seeds}, SAMPLINGS[sampling], samples)


@dataclass
class EvalRound:
    """The evaluation of one version with one sampling: its seeds in a lease book of their own,
    and every answer's rewards. `weights`: what nodes hold at the version, to verify against."""

    version: int
    greedy: bool
    samples: int  # per prompt
    book: LeaseBook
    weights: dict[str, np.ndarray] | None
    opened: float = field(default_factory=time.time)
    rewards: dict[int, list[float]] = field(default_factory=dict)  # seed -> its samples' rewards
    tokens: int = 0  # model tokens generated

    @property
    def sampling(self) -> str:
        return "greedy" if self.greedy else "sampled"

    @property
    def noise_id(self) -> str:
        """What every sample's noise in the round derives from (`TaskLease.noise`): a seed that
        one node leaves and another answers is sampled the same. "" when greedy (no noise)."""
        return "" if self.greedy else self.book.prefix

    def done(self) -> bool:
        return self.book.pending_count == 0 and not self.book.outstanding

    def record(self, now: float) -> dict:
        """The metrics.jsonl line: accuracy is the mean score of every answered sample."""
        scores = [r for rewards in self.rewards.values() for r in rewards]
        return dict(eval_version=self.version, eval_sampling=self.sampling,
                    eval_accuracy=float(np.mean(scores)) if scores else None, eval_samples=len(scores),
                    eval_prompts=len(self.rewards), eval_complete=self.done(), eval_tokens=self.tokens,
                    eval_seconds=now - self.opened, time=now)

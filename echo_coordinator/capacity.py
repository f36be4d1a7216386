"""The capacity model: do the nodes keep the trainer busy? (ECHO-2, arXiv 2602.02192, provisioning rule)

A node's rollout throughput μ_i is measured by the coordinator, not told by the node: the samples
of each accepted batch over the time from the later of its lease's issue and the node's previous
accepted push to the batch's acceptance (judging included: that is when its work can be trained
on), so time a node spent waiting for work does not count against it.
The trainer needs R samples per step and spends T_train seconds on one (training, verification
and publishing: its own thread's work). The swarm keeps the trainer busy when

    Σ μ_i  ≥  R / T_train

In async mode nodes generate while the trainer trains, so the trainer's busy fraction is
min(1, Σμ_i · T_train / R). In sequential mode they take turns: a step waits R / Σμ_i for its
rollouts, then trains, so the busy fraction is T_train / (T_train + R / Σμ_i) and never reaches 1.
Async mode also needs each update to reach the nodes within the staleness slack, S steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 300.0  # seconds of pushes a node's throughput is measured over
MAX_PUSHES = 64  # per node: memory per key stays bounded whatever it sends


@dataclass(frozen=True)
class Capacity:
    produced: float  # samples/s the nodes produce now (Σ μ_i over nodes seen in the window)
    needed: float  # samples/s that keep the trainer busy (R / T_train); 0 before the first step
    nodes: int  # nodes with a measured throughput
    bottleneck: str  # "nodes", "trainer" or "unknown" (nothing measured yet)
    more_nodes: int  # nodes of the median throughput to add so that produced >= needed
    predicted_busy: float | None  # the trainer's busy fraction this model predicts
    update_seconds: float | None  # median time from a publish to a node asking with that version
    slack_seconds: float | None  # async: S × step time, the staleness slack an update must fit in


def busy_share(step_seconds: float, wait_seconds: float) -> float:
    """The share of a step's wall time the trainer was not waiting for rollouts (training,
    verification, publishing): what the model's busy fraction predicts, and the one busy share
    metrics.jsonl (`busy_fraction`), the dashboard and `status` show."""
    return 1.0 - wait_seconds / max(step_seconds, 1e-9)


def plan(rates: list[float], step_seconds: float | None, samples_per_step: int, mode: str,
         staleness: int, update_seconds: float | None = None, cycle_seconds: float | None = None) -> Capacity:
    """The model's verdict from measured node rates (samples/s), the trainer's seconds per step,
    R, the sync mode and S; `cycle_seconds` is the wall time of a step (for the slack)."""
    produced = sum(rates)
    if not step_seconds or step_seconds <= 0:
        return Capacity(produced, 0.0, len(rates), "unknown", 0, None, update_seconds, None)
    needed = samples_per_step / step_seconds
    if produced <= 0:
        return Capacity(0.0, needed, 0, "unknown", 0, None, update_seconds, None)
    if mode == "async":
        busy = min(1.0, produced / needed)
    else:
        busy = step_seconds / (step_seconds + samples_per_step / produced)
    more = max(0, math.ceil((needed - produced) / statistics.median(rates))) if produced < needed else 0
    slack = staleness * cycle_seconds if mode == "async" and cycle_seconds else None
    return Capacity(produced, needed, len(rates), "nodes" if produced < needed else "trainer", more, busy,
                    update_seconds, slack)


class Throughput:
    """Per node: recent accepted pushes, as (time, samples, seconds spent producing them); and
    how long each published version took to reach nodes. Not thread-safe: the service calls it
    under its lock."""

    def __init__(self, window: float = WINDOW):
        self.window = window
        self.pushes: dict[str, deque[tuple[float, int, float]]] = {}
        self.published: dict[int, float] = {}  # version -> when it was published
        self.heard: deque[float] = deque(maxlen=256)  # seconds from publish to a node holding it
        self.held: dict[str, int] = {}  # node id -> version its last signed lease request said it holds

    def pushed(self, node_id: str, samples: int, issued: float, now: float) -> None:
        """An accepted batch of `samples`, answering a lease issued at `issued`."""
        queue = self.pushes.setdefault(node_id, deque(maxlen=MAX_PUSHES))
        started = max(issued, queue[-1][0]) if queue else issued
        queue.append((now, samples, max(now - started, 1e-3)))

    def published_version(self, version: int, now: float) -> None:
        self.published[version] = now
        for old in [v for v in self.published if v < version - 16]:
            del self.published[old]

    def holds(self, node_id: str, version: int, now: float) -> None:
        """A node said (in a signed lease request) it holds `version`."""
        if self.held.get(node_id, -1) < version and version in self.published:
            self.heard.append(now - self.published[version])
        self.held[node_id] = version

    def rate(self, node_id: str, now: float) -> float | None:
        """Samples per second of producing time over the window; None when nothing recent."""
        recent = [(s, t) for at, s, t in self.pushes.get(node_id, ()) if now - at <= self.window]
        if not recent:
            return None
        return sum(s for s, _ in recent) / sum(t for _, t in recent)

    def rates(self, now: float) -> dict[str, float]:
        return {n: r for n in self.pushes if (r := self.rate(n, now)) is not None}

    def update_seconds(self) -> float | None:
        return statistics.median(self.heard) if self.heard else None

    def forget(self, node_id: str) -> None:
        self.pushes.pop(node_id, None)
        self.held.pop(node_id, None)

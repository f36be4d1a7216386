"""What a step trains on: the rollout gate (the trainer's version and the batches it admits) and
the replay buffer of accepted groups, oldest first.

Nothing accepted is ever lost: a batch's groups are in the journal (`journal.py`) before its
push is acknowledged, and a restarted coordinator takes them back (`restore`). Groups the
staleness bound no longer admits are dropped as they are found, counted as "stale" refusals,
and never credited.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass

from echo_coordinator.journal import Group, Journal, Recovered
from echo_coordinator.service.judging import Refused
from echo_coordinator.trainer.samples import TrainSample
from protocols.messages import RolloutBatch
from protocols.sampling import TRAINING_NOISE, sample_seeds
from protocols.sync import Entry, Mode, ReplayBuffer, RolloutGate, Verdict, oldest_admitted


@dataclass(frozen=True)
class Unchecked:
    """An accepted batch in a step whose verification waited for it (`Group.unchecked`): its
    groups, and its samples' places in `StepBatch.samples`."""

    groups: tuple[Group, ...]
    samples: tuple[int, ...]

    @property
    def lease_id(self) -> str:
        return self.groups[0].lease_id

    @property
    def version(self) -> int:
        return self.groups[0].version

    def seeds(self) -> list[int]:
        """Its samples' lease noise, in `samples`' order (`protocols.sampling.sample_seeds`)."""
        return sample_seeds(TRAINING_NOISE, [s.group for g in self.groups for s in g.samples])


@dataclass
class StepBatch:
    samples: list[TrainSample]
    rewards: list[float]
    staleness: list[int]  # per sample: trainer version minus the sample's policy version
    dropped: int  # samples dropped as too stale when the batch was assembled
    unchecked: list[Unchecked] = dataclasses.field(default_factory=list)

    def without(self, settled: list[Unchecked], refused: list[Unchecked]) -> StepBatch:
        """This batch with `settled` verified (no longer unchecked) and the samples of `refused`
        (some of them) left out."""
        gone = {i for u in refused for i in u.samples}
        keep = [i for i in range(len(self.samples)) if i not in gone]
        place = {i: k for k, i in enumerate(keep)}
        return StepBatch([self.samples[i] for i in keep], [self.rewards[i] for i in keep],
                         [self.staleness[i] for i in keep], self.dropped,
                         [Unchecked(u.groups, tuple(place[i] for i in u.samples)) for u in self.unchecked
                          if u not in settled])


class TrainingBuffer:
    """The gate and the buffer. No lock of its own: the service's lock guards it; journal writes
    are queued under it, so they land in the order the state changed, and waited for outside it."""

    def __init__(self, mode: Mode, staleness: int, journal: Journal):
        self.gate = RolloutGate(mode, staleness, version=0)
        # Sequential mode trains only on the requested version: a replay bound of 0.
        self.replay = ReplayBuffer(staleness if mode is Mode.ASYNC else 0)
        self.journal = journal
        self.stale_dropped = 0  # samples dropped from the buffer as stale since this start
        self._dropped = 0  # samples dropped from the buffer as stale since the last take

    @property
    def version(self) -> int:
        return self.gate.version

    def seeds(self) -> set[int]:
        return {entry.item.seed for entry in self.replay}

    def offer(self, batch: RolloutBatch) -> None:
        """The rollout gate's verdict, counted; accepted batches are remembered while their version is admitted."""
        verdict = self.gate.offer(batch.lease_id, batch.version)
        if verdict is not Verdict.ACCEPT:
            raise Refused(verdict, f"batch of version {batch.version} refused at version {self.version}: {verdict.value}")

    def add(self, batch: RolloutBatch, groups: list[Group], book_state: dict) -> Future:
        """Buffer an accepted batch's groups; returns their journal write (with the lease book's
        state, `book_state`, the lease now answered)."""
        for group in groups:
            self.replay.add(group.node_id, group.version, group)
        return self.journal.accept(batch.lease_id, batch.version, groups, book_state)

    def prune(self) -> Future | None:
        """Drop the groups the staleness bound no longer admits; their journal write, if any."""
        dropped = self.replay.prune(self.version)
        return self._drop(dropped) if dropped else None

    def take(self, groups: int | None) -> tuple[StepBatch, Future]:
        """Up to `groups` groups (all if None) the bound still admits, and the rest of an unchecked
        batch whose first groups are among them (its verification judges it whole); and the
        journal write to wait for."""
        dropped = self.replay.prune(self.version)
        entries = list(self.replay)
        count = len(entries) if groups is None else min(groups, len(entries))
        while 0 < count < len(entries) and entries[count].item.unchecked and \
                entries[count].item.lease_id == entries[count - 1].item.lease_id:
            count += 1
        taken, _ = self.replay.take(count, self.version)
        saved = self._drop(dropped, taken=taken)
        batch = StepBatch([], [], [], self._dropped)
        self._dropped = 0
        unchecked: dict[str, tuple[list[Group], list[int]]] = {}
        for entry in taken:
            staleness = self.version - entry.version
            if entry.item.unchecked:
                groups_, places = unchecked.setdefault(entry.item.lease_id, ([], []))
                groups_.append(entry.item)
                places += range(len(batch.samples), len(batch.samples) + len(entry.item.samples))
            batch.samples += [dataclasses.replace(s, staleness=staleness) for s in entry.item.samples]
            batch.rewards += [s.reward for s in entry.item.samples]
            batch.staleness += [staleness] * len(entry.item.samples)
        batch.unchecked = [Unchecked(tuple(g), tuple(p)) for g, p in unchecked.values()]
        return batch, saved

    def oldest_admitted(self, version: int) -> int:
        return oldest_admitted(self.gate.mode, version, self.gate.staleness)

    def restore(self, gate: dict, version: int, recovered: Recovered) -> None:
        """After a restart at `version`: the gate (its counters from `gate`, its accepted lease ids
        from the journal; one an older release wrote without its version counts as `version`'s)
        and every accepted group not yet trained on."""
        accepted = [[version if v is None else v, lease_id] for lease_id, v in sorted(recovered.accepted.items())]
        self.gate = RolloutGate.from_dict({**gate, "version": version, "accepted": accepted, "accepted_keys": []})
        for group in recovered.groups:
            self.replay.add(group.node_id, group.version, group)

    def _drop(self, dropped: list[Entry], taken: list[Entry] | tuple = ()) -> Future:
        """Count groups dropped as too stale; journal them with those `taken`."""
        for entry in dropped:
            self._dropped += len(entry.item.samples)
            self.stale_dropped += len(entry.item.samples)
        return self.journal.take([e.item for e in taken], self.version, [e.item for e in dropped])

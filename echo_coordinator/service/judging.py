"""The decisions of a push, as pure functions: no lock, no service state, no clock.

`pushes` calls them while judging a batch (the sample checks outside the lock, the version rule
under it, where the lease is looked up) and turns a judged batch into GRPO groups with them.
"""

from __future__ import annotations

from collections import Counter

from echo_coordinator.journal import Group
from echo_coordinator.trainer.samples import TrainSample
from protocols.errors import InvalidValue, ProtocolError
from protocols.messages import RolloutBatch
from protocols.sync import Verdict


class Refused(ProtocolError):
    """A batch the rollout gate turned down; `code` is the verdict: stale, future, duplicate or
    wrong_version, so ledger and metrics count each reason apart."""

    def __init__(self, verdict: Verdict, message: str):
        super().__init__(message)
        self.code = verdict.value


def check_samples(batch: RolloutBatch, prompts: dict[int, tuple[int, ...]], group: int, vocab_size: int) -> None:
    """A batch answers its lease exactly: `group` samples for each leased seed (`prompts`: seed ->
    the leased prompt), each on that seed's prompt, every token inside the vocabulary."""
    batch.check_vocab(vocab_size)
    per_seed = Counter(s.seed for s in batch.samples)
    if set(per_seed) != set(prompts) or any(n != group for n in per_seed.values()):
        raise InvalidValue(f"batch must hold {group} samples for each leased seed {sorted(prompts)}, got {dict(per_seed)}")
    for s in batch.samples:
        if s.prompt_ids != prompts[s.seed]:
            raise InvalidValue(f"sample for seed {s.seed} does not use the leased prompt")


def check_claimed_version(lease_version: int, claimed: int) -> None:
    """Refuse a batch that claims another policy version than its lease's: each lease fixes the
    one version its batch is sampled with (`protocols.sync.lease_version`; an evaluation, its
    round's), so a node cannot sample under several and push the best."""
    if claimed != lease_version:
        verdict = Verdict.FUTURE if claimed > lease_version else Verdict.WRONG_VERSION
        raise Refused(verdict, f"{verdict.value}: batch claims version {claimed}; its lease is of version {lease_version}")


def groups(batch: RolloutBatch, rewards: list[float], peer_id: str, name: str, unchecked: bool = False) -> list[Group]:
    """A judged batch as GRPO groups, one per seed, with the rewards we computed (`unchecked`: its
    verification waits for the step that trains it)."""
    by_seed: dict[int, list[TrainSample]] = {}
    for s, reward in zip(batch.samples, rewards):
        by_seed.setdefault(s.seed, []).append(TrainSample.of(s, reward))
    return [Group(batch.lease_id, seed, batch.version, tuple(samples), batch.node_id, peer_id, name,
                  tokens=sum(sum(s.loss_mask) for s in samples), unchecked=unchecked)  # tokens: the node's, not env turns
            for seed, samples in by_seed.items()]

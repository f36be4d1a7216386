"""What the trainer trains on (`TrainSample`) and its one codec, torch-free: the service, the
journal and the verifier build and store samples without loading torch.

The codec is msgpack of plain lists (no pickle: the journal reads back only what it wrote, the
worker ranks only what rank 0 sent, but neither should be able to run code).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from protocols.messages import RolloutSample


@dataclass(frozen=True)
class TrainSample:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behaviour: tuple[float, ...]  # node logprobs, one per completion token
    loss_mask: tuple[int, ...]
    reward: float
    group: int  # samples of the same prompt share a group
    staleness: int = 0  # trainer version minus the version that generated it

    @classmethod
    def of(cls, sample: RolloutSample, reward: float = 0.0) -> TrainSample:
        """A judged rollout sample, with the reward the trainer computed for it."""
        return cls(sample.prompt_ids, sample.completion_ids, sample.logprobs, sample.loss_mask, reward, sample.seed)


def encode(samples: Iterable[TrainSample]) -> bytes:
    return msgpack.packb([[list(s.prompt_ids), list(s.completion_ids), list(s.behaviour), list(s.loss_mask), s.reward,
                           s.group, s.staleness] for s in samples])


def decode(payload: bytes) -> list[TrainSample]:
    """`encode`'s samples. Journals written before staleness was encoded have six fields (staleness 0)."""
    return [TrainSample(tuple(p), tuple(c), tuple(b), tuple(m), float(r), int(g), int(st[0]) if st else 0)
            for p, c, b, m, r, g, *st in msgpack.unpackb(payload)]

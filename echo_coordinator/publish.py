"""Turning trainer weights into signed WeightUpdates plus the content-addressed chunks that carry them.

LoRA mode: every update is the whole adapter (its own snapshot), 0 -> v.
Full mode: every update is a lossy delta v-1 -> v computed against what nodes actually hold
(`protocols.delta.DeltaEncoder`, error feedback), so node weights stay bit-identical to the
publisher's view; every `snapshot_every` versions a full fp32 snapshot 0 -> v of that view is
published too, so a late joiner need not replay every delta.
"""

from __future__ import annotations

import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocols import chunks, delta
from protocols.messages import TensorEntry, WeightUpdate
from protocols.signing import sign_message

Published = tuple[WeightUpdate, dict[str, bytes]]


def signed_update(
    run_id: str, from_version: int, to_version: int, mode: str, payloads: dict[str, tuple[tuple[int, ...], str, bytes]],
    replaces: bool, params: dict, key: Ed25519PrivateKey, chunk_size: int = chunks.DEFAULT_CHUNK_SIZE,
) -> Published:
    """`payloads`: tensor name -> (shape, encoding, payload bytes)."""
    entries, store = [], {}
    for name in sorted(payloads):
        shape, encoding, payload = payloads[name]
        pieces = chunks.split(payload, chunk_size)
        store.update(pieces)
        entries.append(TensorEntry(name=name, shape=tuple(shape), dtype="float32", encoding=str(encoding),
                                   nbytes=len(payload), chunks=tuple(d for d, _ in pieces)))
    update = WeightUpdate(
        run_id=run_id, from_version=from_version, to_version=to_version, mode=mode, tensors=tuple(entries),
        chunk_size=chunk_size, replaces=replaces, params=params, created=time.time(),
    )
    return sign_message(update, key), store


def build_lora_update(
    run_id: str, version: int, adapter: dict[str, np.ndarray], params: dict, key: Ed25519PrivateKey,
    chunk_size: int = chunks.DEFAULT_CHUNK_SIZE,
) -> Published:
    fp32 = delta.Encoding.DENSE_FP32
    payloads = {n: (a.shape, fp32, delta.encode(a, fp32, name=n)) for n, a in adapter.items()}
    return signed_update(run_id, 0, version, "lora", payloads, True, params, key, chunk_size)


class FullPublisher:
    """Full-parameter updates with error feedback. `base` is the weights every node starts from."""

    def __init__(self, run_id: str, key: Ed25519PrivateKey, base: dict[str, np.ndarray], encoding: str, density: float,
                 snapshot_every: int, chunk_size: int = chunks.DEFAULT_CHUNK_SIZE):
        self.run_id, self.key, self.encoding, self.density = run_id, key, delta.Encoding(encoding), density
        self.snapshot_every, self.chunk_size = snapshot_every, chunk_size
        self.encoder = delta.DeltaEncoder(base)

    def publish(self, version: int, weights: dict[str, np.ndarray]) -> list[Published]:
        """The delta to `version`, plus a snapshot when `version` is a multiple of snapshot_every."""
        encoded = self.encoder.encode_update(weights, self.encoding, self.density)
        payloads = {n: (weights[n].shape, self.encoding, p) for n, p in encoded.items()}
        out = [signed_update(self.run_id, version - 1, version, "full", payloads, False, {}, self.key, self.chunk_size)]
        if version % self.snapshot_every == 0:
            out.append(self.snapshot(version))
        return out

    def snapshot(self, version: int) -> Published:
        fp32 = delta.Encoding.DENSE_FP32
        payloads = {}
        for name in self.encoder.names:
            view = self.encoder.view(name)
            payloads[name] = (view.shape, fp32, delta.encode(np.ascontiguousarray(view), fp32, name=name))
        return signed_update(self.run_id, 0, version, "full", payloads, True, {}, self.key, self.chunk_size)

    def view(self) -> dict[str, np.ndarray]:
        """What every up-to-date node holds, bit for bit."""
        return {name: self.encoder.view(name) for name in self.encoder.names}

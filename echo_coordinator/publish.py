"""Turning trainer weights into signed WeightUpdates plus the content-addressed chunks that carry them.

Both modes publish lossy deltas v-1 -> v computed against what nodes actually hold
(`protocols.delta.DeltaEncoder`, error feedback), so node weights stay bit-identical to the
publisher's view, and every `snapshot_every` versions a snapshot 0 -> v of that view, so a late
joiner need not replay every delta.
- full: nodes start from the base weights; the view and its snapshots are fp32.
- lora: nodes start with no adapter, so the first update is a snapshot of the adapter; the view is
  kept in bf16 and snapshots travel in bf16, exactly. Deltas are dense int4 by default: every
  adapter weight moves every step, and top-k deltas left nodes many versions behind. A delta of
  SmolLM2's r=16 adapter is 0.96 % of its bf16 checkpoint, a snapshot 3.6 % (bench/lora_updates.py).
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


class Publisher:
    """The updates of one run. `base`: what every node starts from (full mode's base weights, or
    the view a restart saved); None for a LoRA run before its first update."""

    def __init__(self, run_id: str, key: Ed25519PrivateKey, mode: str, base: dict[str, np.ndarray] | None,
                 encoding: str, density: float, snapshot_every: int, params: dict | None = None,
                 chunk_size: int = chunks.DEFAULT_CHUNK_SIZE):
        self.run_id, self.key, self.mode, self.encoding, self.density = run_id, key, mode, delta.Encoding(encoding), density
        self.snapshot_every, self.params, self.chunk_size = snapshot_every, dict(params or {}), chunk_size
        self.bf16 = mode == "lora"
        self.encoder = None if base is None else delta.DeltaEncoder(base, bf16=self.bf16)

    def publish(self, version: int, weights: dict[str, np.ndarray] | None,
                encoded: dict[str, bytes] | None = None) -> list[Published]:
        """The delta to `version` toward `weights`, or made of payloads a sharded trainer
        `encoded` where its shards live; plus a snapshot when `version` is a multiple of
        snapshot_every."""
        if self.encoder is None:  # LoRA's first update: the adapter itself
            self.encoder = delta.DeltaEncoder({n: delta.round_bf16(w) for n, w in weights.items()}, bf16=True)
            return [self.snapshot(version)]
        if encoded is None:
            encoded = self.encoder.encode_update(weights, self.encoding, self.density)
        else:
            self.encoder.advance(encoded, self.encoding)
        weights = self.view()  # (only their shapes are read below)
        payloads = {n: (weights[n].shape, self.encoding, p) for n, p in encoded.items()}
        out = [signed_update(self.run_id, version - 1, version, self.mode, payloads, False, self.params, self.key,
                             self.chunk_size)]
        if version % self.snapshot_every == 0:
            out.append(self.snapshot(version))
        return out

    def snapshot(self, version: int) -> Published:
        encoding = delta.Encoding.DENSE_BF16 if self.bf16 else delta.Encoding.DENSE_FP32
        payloads = {}
        for name in self.encoder.names:
            view = self.encoder.view(name)
            payloads[name] = (view.shape, encoding, delta.encode(np.ascontiguousarray(view), encoding, name=name))
        return signed_update(self.run_id, 0, version, self.mode, payloads, True, self.params, self.key, self.chunk_size)

    def view(self) -> dict[str, np.ndarray]:
        """What every up-to-date node holds, bit for bit."""
        return {name: self.encoder.view(name) for name in self.encoder.names}

"""Turning trainer weights into a signed WeightUpdate plus the chunks that carry it."""

from __future__ import annotations

import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocols import chunks, delta
from protocols.messages import TensorEntry, WeightUpdate
from protocols.signing import sign_message


def build_lora_update(
    run_id: str, version: int, adapter: dict[str, np.ndarray], params: dict, key: Ed25519PrivateKey,
    chunk_size: int = chunks.DEFAULT_CHUNK_SIZE,
) -> tuple[WeightUpdate, dict[str, bytes]]:
    """LoRA mode: every update carries the whole adapter (it is its own snapshot), so it goes from
    version 0 (the base model) to `version` and a node at any version can apply it directly."""
    entries, store = [], {}
    for name in sorted(adapter):
        payload = delta.encode(adapter[name], delta.Encoding.DENSE_FP32, name=name)
        pieces = chunks.split(payload, chunk_size)
        store.update(pieces)
        entries.append(TensorEntry(
            name=name, shape=tuple(adapter[name].shape), dtype="float32", encoding=delta.Encoding.DENSE_FP32.value,
            nbytes=len(payload), chunks=tuple(d for d, _ in pieces),
        ))
    update = WeightUpdate(
        run_id=run_id, from_version=0, to_version=version, mode="lora", tensors=tuple(entries), chunk_size=chunk_size,
        replaces=True, params=params, created=time.time(),
    )
    return sign_message(update, key), store

"""The publisher: signed updates whose chunks are content-addressed, deltas against what nodes
hold, snapshots on schedule, and a view that equals, bit for bit, what a node that applied every
update holds (error feedback: nodes never drift from what the trainer believes they run)."""

from __future__ import annotations

import numpy as np
import pytest

from echo_coordinator.publish import Publisher
from protocols import chunks, delta
from protocols.errors import SignatureError
from protocols.signing import generate_key, public_bytes, sha256_hex, verify_message


def node_applies(held: dict[str, np.ndarray], published, bf16: bool) -> dict[str, np.ndarray]:
    """What a node holds after one published update: chunks checked and joined, then decoded."""
    update, store = published
    out = dict(held)
    for t in update.tensors:
        assert all(sha256_hex(store[d]) == d for d in t.chunks)
        payload = chunks.assemble(t, store.__getitem__)
        if update.replaces:
            out[t.name] = delta.decode(payload, t.encoding, t.shape, name=t.name)
        else:
            out[t.name] = delta.apply(held[t.name], payload, t.encoding, name=t.name, bf16=bf16)
    return out


@pytest.mark.parametrize("mode,encoding", [("full", "topk-int8"), ("lora", "dense-int4")])
def test_nodes_that_apply_every_update_hold_the_view_bit_for_bit(mode, encoding):
    rng = np.random.default_rng(0)
    key = generate_key()
    weights = {"a.weight": rng.normal(size=(16, 8)).astype(np.float32), "b.weight": rng.normal(size=64).astype(np.float32)}
    base = None if mode == "lora" else {k: v.copy() for k, v in weights.items()}
    publisher = Publisher("run-1", key, mode, base, encoding, density=0.1, snapshot_every=3, params={"alpha": 8},
                          chunk_size=100)
    held = {} if base is None else {k: v.copy() for k, v in base.items()}
    for version in range(1, 7):
        weights = {k: v + rng.normal(scale=0.01, size=v.shape).astype(np.float32) for k, v in weights.items()}
        published = publisher.publish(version, weights)
        kinds = [u.replaces for u, _ in published]
        first_lora = mode == "lora" and version == 1
        assert kinds == ([True] if first_lora else [False, True] if version % 3 == 0 else [False])
        for update, _ in published:
            verify_message(update, public_bytes(key))  # signed by the run key
            assert (update.from_version, update.to_version) == ((0 if update.replaces else version - 1), version)
            assert update.params == {"alpha": 8} and all(len(t.chunks) >= 1 for t in update.tensors)
        held = node_applies(held, published[0], bf16=mode == "lora")  # the delta (or the first snapshot)
        view = publisher.view()
        assert set(view) == set(held) and all(np.array_equal(view[k], held[k]) for k in view)
        if len(published) == 2:  # a late joiner takes the snapshot alone and holds the same
            late = node_applies({}, published[1], bf16=mode == "lora")
            assert all(np.array_equal(late[k], view[k]) for k in view)
    # Lossy deltas, but the view tracks the trainer closely.
    assert max(float(np.abs(view[k] - weights[k]).max()) for k in view) < 0.05


def test_an_update_signed_by_another_key_is_refused():
    publisher = Publisher("run-1", generate_key(), "full", {"w": np.zeros(4, np.float32)}, "dense-fp32", 1.0, 10)
    (update, _), = publisher.publish(1, {"w": np.ones(4, np.float32)})
    with pytest.raises(SignatureError):
        verify_message(update, public_bytes(generate_key()))


def test_a_resumed_publisher_continues_from_the_saved_view():
    """A restart rebuilds the publisher from the checkpoint's view: its snapshot is what nodes hold."""
    key = generate_key()
    first = Publisher("run-1", key, "full", {"w": np.zeros(8, np.float32)}, "topk-int8", 0.5, 10)
    first.publish(1, {"w": np.linspace(0, 1, 8, dtype=np.float32)})
    resumed = Publisher("run-1", key, "full", first.view(), "topk-int8", 0.5, 10)
    update, store = resumed.snapshot(1)
    assert update.replaces and np.array_equal(node_applies({}, (update, store), bf16=False)["w"], first.view()["w"])

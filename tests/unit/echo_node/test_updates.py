"""Full mode: a node applying the publisher's lossy deltas holds the publisher's view bit for bit."""

import dataclasses

import numpy as np
import pytest

from echo_coordinator.publish import FullPublisher
from echo_node.full_weights import apply_update
from protocols import chunks
from protocols.errors import CodecError, IntegrityError
from protocols.signing import generate_key


def payloads(update, store):
    return {t.name: chunks.assemble(t, store.__getitem__) for t in update.tensors}


@pytest.mark.parametrize("encoding, density", [("topk-int8", 0.05), ("dense-bf16", 1.0), ("dense-fp16", 1.0)])
def test_node_weights_equal_the_broadcast_view_after_20_lossy_updates(encoding, density):
    rng = np.random.default_rng(0)
    base = {"a": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(100).astype(np.float32)}
    publisher = FullPublisher("run", generate_key(), base, encoding, density, snapshot_every=5, chunk_size=1000)
    node = {k: v.copy() for k, v in base.items()}
    trainer = {k: v.copy() for k, v in base.items()}
    late_joiner = None
    for version in range(1, 21):
        trainer = {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in trainer.items()}
        published = publisher.publish(version, trainer)
        (delta_update, delta_store), *snapshot = published
        assert (delta_update.from_version, delta_update.to_version, delta_update.replaces) == (version - 1, version, False)
        node.update(apply_update(node, delta_update, payloads(delta_update, delta_store)))
        for name, view in publisher.view().items():
            assert node[name].tobytes() == view.tobytes(), (version, name)  # bit for bit
        assert len(snapshot) == (version % 5 == 0)
        if snapshot and version == 15:
            update, store = snapshot[0]
            late_joiner = apply_update({k: np.zeros_like(v) for k, v in base.items()}, update, payloads(update, store))
        elif late_joiner is not None:
            late_joiner.update(apply_update(late_joiner, delta_update, payloads(delta_update, delta_store)))
    assert all(late_joiner[k].tobytes() == node[k].tobytes() for k in node)  # snapshot at 15 + 5 deltas
    residual = max(float(np.abs(trainer[k] - node[k]).max()) for k in node)
    assert residual < 0.05  # error feedback keeps the lossy view close to the trainer


def test_bad_updates_change_nothing():
    base = {"a": np.ones((4, 4), np.float32)}
    publisher = FullPublisher("run", generate_key(), base, "topk-int8", 0.5, snapshot_every=100, chunk_size=16)
    (update, store), = publisher.publish(1, {"a": np.full((4, 4), 2.0, np.float32)})
    node = {"a": base["a"].copy()}
    good = payloads(update, store)
    with pytest.raises(CodecError):
        apply_update(node, update, {"a": good["a"][:-1]})
    with pytest.raises(CodecError, match="does not have"):
        apply_update({"b": node["a"]}, update, good)
    renamed = dataclasses.replace(update, tensors=(dataclasses.replace(update.tensors[0], shape=(2, 8)),))
    with pytest.raises(CodecError):
        apply_update(node, renamed, good)
    tampered = {d: b"x" + data[1:] for d, data in store.items()}
    with pytest.raises(IntegrityError):
        payloads(update, tampered)
    assert node["a"].tobytes() == base["a"].tobytes()

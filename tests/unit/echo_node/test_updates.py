"""A node applying the publisher's lossy deltas holds the publisher's view bit for bit, in full and LoRA mode."""

import dataclasses

import numpy as np
import pytest

from echo_coordinator.publish import Publisher
from echo_node.disk import Disk
from echo_node.updates import apply_update, check_manifest
from protocols import chunks, delta
from protocols.errors import CodecError, IntegrityError
from protocols.signing import generate_key
from tests.unit.protocols import factories


def payloads(update, store):
    return {t.name: chunks.assemble(t, store.__getitem__) for t in update.tensors}


@pytest.mark.parametrize("encoding, density", [("topk-int8", 0.05), ("dense-bf16", 1.0), ("dense-fp16", 1.0)])
def test_node_weights_equal_the_broadcast_view_after_20_lossy_updates(encoding, density):
    rng = np.random.default_rng(0)
    base = {"a": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(100).astype(np.float32),
            "experts": rng.standard_normal((4, 16, 8)).astype(np.float32)}  # a mixture of experts' 3-D tensor
    publisher = Publisher("run", generate_key(), "full", base, encoding, density, snapshot_every=5, chunk_size=1000)
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


def test_lora_nodes_start_from_a_bf16_snapshot_and_hold_the_view_bit_for_bit():
    rng = np.random.default_rng(1)
    shapes = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (8, 64),
              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (64, 8)}
    trainer = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    publisher = Publisher("run", generate_key(), "lora", None, "dense-int4", 1.0, snapshot_every=5,
                          params={"alpha": 16.0}, chunk_size=1000)
    node, late_joiner = {}, None
    for version in range(1, 16):
        trainer = {k: v + 1e-3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in trainer.items()}
        published = publisher.publish(version, trainer)
        first = published[0][0]
        if version == 1:  # nodes hold no adapter yet: the adapter itself, in bf16
            assert (first.from_version, first.replaces, len(published)) == (0, True, 1)
            assert {t.encoding for t in first.tensors} == {"dense-bf16"}
        else:
            assert (first.from_version, first.replaces, first.params) == (version - 1, False, {"alpha": 16.0})
            assert sum(t.nbytes for t in first.tensors) < 0.3 * sum(v.size * 2 for v in trainer.values())
        new = apply_update(node, first, payloads(*published[0]))
        node = new if first.replaces else {**node, **new}
        for name, view in publisher.view().items():
            assert node[name].tobytes() == view.tobytes(), (version, name)
            assert np.array_equal(delta.round_bf16(view), view)  # bf16-valued
        if version == 10:
            (snapshot, store), = [p for p in published if p[0].replaces]
            late_joiner = apply_update({}, snapshot, payloads(snapshot, store))
        elif late_joiner is not None:
            late_joiner = {**late_joiner, **apply_update(late_joiner, first, payloads(*published[0]))}
    assert all(late_joiner[k].tobytes() == node[k].tobytes() for k in node)  # the bf16 snapshot is exact
    residual = max(float(np.abs(trainer[k] - node[k]).max()) for k in node)
    assert residual < 0.05


def test_bad_updates_change_nothing():
    base = {"a": np.ones((4, 4), np.float32)}
    publisher = Publisher("run", generate_key(), "full", base, "topk-int8", 0.5, snapshot_every=100, chunk_size=16)
    (update, store), = publisher.publish(1, {"a": np.full((4, 4), 2.0, np.float32)})
    node = {"a": base["a"].copy()}
    good = payloads(update, store)
    with pytest.raises(CodecError):
        apply_update(node, update, {"a": good["a"][:-1]})
    with pytest.raises(CodecError, match="does not have"):
        apply_update({"b": node["a"]}, update, good)
    with pytest.raises(CodecError, match="nothing to apply it to"):  # a delta before any snapshot
        apply_update({}, update, good)
    renamed = dataclasses.replace(update, tensors=(dataclasses.replace(update.tensors[0], shape=(2, 8)),))
    with pytest.raises(CodecError):
        apply_update(node, renamed, good)
    tampered = {d: b"x" + data[1:] for d, data in store.items()}
    with pytest.raises(IntegrityError):
        payloads(update, tampered)
    assert node["a"].tobytes() == base["a"].tobytes()


def test_a_first_snapshot_may_not_declare_more_values_than_the_base_model_holds():
    """A compression bomb: a topk-int8 snapshot of a few bytes that declares a 2**16 x 2**12 tensor
    (256 M values, 1 GiB as float32) is refused before anything is decoded: from its manifest alone,
    which the node checks before it fetches a chunk (`Versions._check`, issue 36 point 5)."""
    publisher = Publisher("run", generate_key(), "lora", None, "topk-int8", 0.01, snapshot_every=100, chunk_size=1024)
    (update, store), = publisher.publish(1, {"lora_A": np.ones((4, 64), np.float32)})
    assert apply_update({}, update, payloads(update, store), max_elements=1000)["lora_A"].shape == (4, 64)
    bomb = dataclasses.replace(update, tensors=(dataclasses.replace(update.tensors[0], shape=(2**16, 2**12)),))
    with pytest.raises(CodecError, match="more than the base model's 1,000 parameters"):
        apply_update({}, bomb, payloads(update, store), max_elements=1000)
    with pytest.raises(CodecError, match="more than the base model's 1,000 parameters"):
        check_manifest({}, bomb, max_elements=1000)


def test_an_adapter_llama_cpp_refuses_is_not_left_on_disk(tmp_path, monkeypatch):
    import asyncio

    from echo_node import updates

    monkeypatch.setattr(updates, "write_lora_adapter", lambda adapter, alpha, path, layout: path.write_bytes(b"x" * 99))

    class Refusing:
        layout = None

        def set_adapter(self, path):
            raise ValueError("llama.cpp could not load the adapter")

    update = dataclasses.replace(factories.update(), params={"alpha": 8.0})
    with pytest.raises(ValueError, match="could not load"):
        asyncio.run(updates.load_lora({}, update, Refusing(), Disk(tmp_path, None)))
    assert list((tmp_path / "adapters").iterdir()) == []

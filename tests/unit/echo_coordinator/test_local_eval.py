"""`echo-coordinator eval` picks the weights of the version asked for from the run directory, and
says which versions it can evaluate when it cannot. (The evaluation itself, on a real trainer and
run, is in tests/integration/test_end_to_end.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from echo_coordinator.config import RunConfig
from echo_coordinator.local_eval import weights_of
from echo_coordinator.run_dir import RunDir
from protocols.errors import EchoError

A, B = "m.layers.0.q_proj.lora_A.weight", "m.layers.0.q_proj.lora_B.weight"


class FakeTrainer:
    """What `weights_of` asks of a trainer: its current weights (the base, or a fresh adapter)."""

    def __init__(self, weights):
        self._weights = weights

    def weights(self):
        return {k: v.copy() for k, v in self._weights.items()}


def test_lora_version_zero_is_the_bare_base_and_later_versions_are_the_saved_adapters(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.create()
    fresh = {A: np.ones((2, 4), np.float32), B: np.full((4, 2), 0.5, np.float32)}
    v0 = weights_of(run_dir, RunConfig(), FakeTrainer(fresh), 0)
    assert np.array_equal(v0[A], fresh[A]) and not v0[B].any()  # B = 0: the adapter adds nothing
    save_file({A: fresh[A], B: fresh[B] * 3}, str(run_dir.adapter(2)))
    save_file({A: fresh[A], B: fresh[B]}, str(run_dir.adapter(2, held=True)))  # what nodes held: not this
    assert np.array_equal(weights_of(run_dir, RunConfig(), FakeTrainer(fresh), 2)[B], fresh[B] * 3)
    with pytest.raises(EchoError, match=r"no adapter of version 5 .* versions saved: \[0, 2\]"):
        weights_of(run_dir, RunConfig(), FakeTrainer(fresh), 5)


def test_a_full_mode_run_evaluates_its_latest_version_only(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.create()
    base = {"w": np.zeros(3, np.float32)}
    full = RunConfig(update="full")
    run_dir.write_state("run-1", 0, {})
    assert np.array_equal(weights_of(run_dir, full, FakeTrainer(base), 0)["w"], base["w"])
    checkpoint = run_dir.checkpoint(3)
    checkpoint.mkdir(parents=True)
    save_file({"w": np.arange(3, dtype=np.float32)}, str(checkpoint / "weights.safetensors"))
    run_dir.write_state("run-1", 3, {})
    assert np.array_equal(weights_of(run_dir, full, FakeTrainer(base), 3)["w"], [0, 1, 2])
    with pytest.raises(EchoError, match=r"keeps only its latest version \(3\); version 2 cannot"):
        weights_of(run_dir, full, FakeTrainer(base), 2)

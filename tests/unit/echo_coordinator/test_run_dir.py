"""The run directory's layout: state.json replaced atomically and naming the one checkpoint kept,
config.json read back as strictly as run.toml, base.json, and the paths other modules ask for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from echo_coordinator.base_model import BaseModel
from echo_coordinator.config import RunConfig, TrainerConfig
from protocols.errors import ConfigError
from echo_coordinator.run_dir import RunDir, RunDirError, RunState


class FakeTrainer:
    def save(self, directory: Path, weights) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({"w": np.zeros(1, dtype=np.float32)}, str(directory / "weights.safetensors"))


def test_a_new_run_has_no_state_and_version_zero_names_no_checkpoint(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    assert run_dir.adapters.is_dir() and run_dir.load_state() is None
    run_dir.write_state("run-1", 0, {"gate": 0})
    assert run_dir.load_state() == RunState("run-1", 0, None, {"gate": 0})
    assert json.loads(run_dir.state_file.read_text())["checkpoint"] is None


def test_state_names_the_new_checkpoint_and_the_others_go(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.create()
    view = {"w": np.zeros(2, dtype=np.float32)}
    for version in (1, 2):
        run_dir.save_checkpoint(version, FakeTrainer(), {}, view)
    (run_dir.checkpoints / "v3").mkdir()  # half-written by a crash before its state.json
    run_dir.write_state("run-1", 2, {})
    assert sorted(p.name for p in run_dir.checkpoints.iterdir()) == ["v2"]
    state = run_dir.load_state()
    assert state.version == 2 and state.checkpoint == run_dir.checkpoint(2)
    assert run_dir.view_of(state.checkpoint).exists() and list(run_dir.weights_of(state.checkpoint)) == ["w"]
    assert json.loads(run_dir.state_file.read_text())["checkpoint"] == "checkpoints/v2"  # the on-disk format


def test_state_is_replaced_whole(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path)
    run_dir.create()
    run_dir.write_state("run-1", 0, {})

    def crash(self, target):
        raise OSError("disk full")

    monkeypatch.setattr(Path, "replace", crash)  # the temporary file is written, the rename fails
    with pytest.raises(OSError):
        run_dir.write_state("run-1", 1, {})
    monkeypatch.undo()
    assert run_dir.load_state().version == 0  # the old state.json, whole


def test_an_unreadable_state_is_a_clear_error(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.state_file.write_text('{"version": 1')
    with pytest.raises(RunDirError, match="cannot read .*state.json"):
        run_dir.load_state()


def test_paths(tmp_path):
    run_dir = RunDir(tmp_path)
    assert run_dir.adapter(3) == tmp_path / "adapters" / "v3.safetensors"
    assert run_dir.adapter(3, held=True) == tmp_path / "adapters" / "v3.held.safetensors"
    assert run_dir.checkpoint(4) == tmp_path / "checkpoints" / "v4"
    assert run_dir.trainer_log(1) == tmp_path / "trainer-rank1.log"
    assert (run_dir.ledger.name, run_dir.metrics.name, run_dir.join_file.name) == ("ledger.sqlite", "metrics.jsonl",
                                                                                  "join.txt")
    assert RunDir("~/x").root == Path.home() / "x"


def test_adapter_versions_skip_the_held_copies(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.create()
    for version in (2, 10, 1):
        run_dir.adapter(version).write_bytes(b"")
        run_dir.adapter(version, held=True).write_bytes(b"")
    assert run_dir.adapter_versions() == [1, 2, 10]


def test_config_round_trips(tmp_path):
    run_dir = RunDir(tmp_path)
    run, trainer = RunConfig(steps=7, task_params={"digits": 2}, temperature=0.7), TrainerConfig(lora_rank=8)
    run_dir.write_config(run, trainer)
    assert run_dir.read_config() == (run, trainer)


def test_config_refuses_an_unknown_field_by_name(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.write_config(RunConfig(), TrainerConfig())
    raw = json.loads(run_dir.config_file.read_text())
    raw["run"]["stepz"] = 3
    run_dir.config_file.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['stepz'\] in .*config.json"):
        run_dir.read_config()


def test_config_missing_or_broken(tmp_path):
    run_dir = RunDir(tmp_path)
    with pytest.raises(RunDirError, match="missing config.json"):
        run_dir.read_config()
    run_dir.config_file.write_text("[1, 2]")
    with pytest.raises(RunDirError, match="not a JSON object"):
        run_dir.read_config()


def test_base_is_recorded_for_eval_and_export(tmp_path):
    run_dir = RunDir(tmp_path)
    with pytest.raises(RunDirError, match="no readable base.json"):
        run_dir.base_source()
    run_dir.record_base(BaseModel(tmp_path / "model", tmp_path / "model.gguf", "llama"))
    assert run_dir.base_source() == tmp_path / "model"

"""A run whose trainer is two processes (`--trainer-procs 2`, gloo on 127.0.0.1): rank 0 runs the
swarm, rank 1 only trains, the ranks agree after every step, and the run ends with both processes
gone. Sharded (FSDP2), in full mode: rank 1 also takes part in rank 0's verification gathers,
encodes its part of every update and writes its shards of every checkpoint, which `export` reads
back whole."""

import re
import sys

import pytest

from echo_coordinator.run_dir import RunDir

from tests.support.runs import async_config, start_node
from tests.support.runs import spawn, wait_for
from tests.support.runs import check_books, metrics


# LoRA unsharded in `make test-all` only (35 s): its step on two ranks is checked against one process's in
# test_distributed for every mode and sharding; the sharded full-mode run covers the run's wiring.
@pytest.mark.parametrize("update, sharding", [pytest.param("lora", "none", marks=pytest.mark.slow), ("full", "fsdp")])
def test_a_run_trains_on_two_trainer_processes(tmp_path, tiny_model, processes, update, sharding):
    run_dir, steps = tmp_path / "run", 4
    config = async_config(tmp_path / "run.toml", tiny_model, run_dir, steps, 2, extra=f'update = "{update}"',
                          trainer=f'sharding = "{sharding}"')
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config),
                                    "--trainer-procs", "2", "--verbose"], tmp_path / "coordinator.log")
    wait_for((run_dir / "join.txt").exists, 180, "the join line", [coordinator])
    join = (run_dir / "join.txt").read_text().strip()
    nodes = [start_node(processes, join, tmp_path, name) for name in ("n1", "n2")]
    assert coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    log = (tmp_path / "coordinator.log").read_text()
    assert "rank 0 of 2" in log
    rank1 = (run_dir / "trainer-rank1.log").read_text()
    assert "trainer rank 1 of 2 joined (gloo on cpu)" in rank1, rank1
    records = metrics(run_dir)
    assert [r["version"] for r in records] == list(range(steps))
    assert all(r["trained_samples"] > 0 for r in records)  # every step trained (and the ranks agreed)
    check_books(run_dir)
    for node in nodes:
        assert node.wait(timeout=60) == 0
    assert not re.search(r"disagree|Traceback", log + rank1)
    if sharding == "fsdp":  # checkpoints hold each rank's shards; export reads them back whole
        from echo_coordinator.export import export

        checkpoint = RunDir(run_dir).load_state().checkpoint
        assert (checkpoint / "model").is_dir() and not (checkpoint / "weights.safetensors").exists()
        written = export(run_dir, tmp_path / "export", steps, say=lambda _: None)
        assert "model.safetensors" in {p.name for p in written}

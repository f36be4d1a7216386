"""Async push-pull with real processes: a slow node under S=1, and a trainer restart."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import sqlite3
import sys
from pathlib import Path

from tests.integration.test_end_to_end import VENV_BIN, processes, spawn, tiny_model, wait_for  # noqa: F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def async_config(path: Path, model: Path, data_dir: Path, steps: int, staleness: int, port: int = 0, extra: str = "",
                 lease_seconds: float = 120) -> Path:
    path.write_text(f"""
[run]
model = "{model}"
task = "tests.support.envs:LetterE"
mode = "async"
staleness = {staleness}
steps = {steps}
prompts_per_step = 2
group_size = 4
max_new_tokens = 8
min_nodes = 2
port = {port}
data_dir = "{data_dir}"
lease_seconds = {lease_seconds}
{extra}

[trainer]
lora_rank = 4
learning_rate = 0.01
threads = 1
""")
    return path


def start_coordinator(processes, config: Path, log: Path):
    return spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)], log)


def start_node(processes, join_line: str, tmp_path: Path, name: str, slow_delay: float | None = None):
    argv = shlex.split(join_line)
    args = [*argv[1:], "--name", name, "--data-dir", str(tmp_path / name), "--threads", "1"]
    if slow_delay is None:
        return spawn(processes, [str(VENV_BIN / "echo-node"), *args], tmp_path / f"{name}.log")
    return spawn(processes, [sys.executable, "-m", "tests.support.slow_node", *args], tmp_path / f"{name}.log",
                 SLOW_NODE_DELAY=str(slow_delay))


def metrics(run_dir: Path, evals: bool = False) -> list[dict]:
    """Step records (or, with `evals`, evaluation records) of metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if ("eval_version" in r) == evals]


def test_slow_node_under_s1_is_dropped_and_counted(tmp_path, tiny_model, processes):
    # Enough steps that the slow node's pushes (6 s late) land while the run goes on.
    run_dir, steps = tmp_path / "run", 20
    coordinator = start_coordinator(processes, async_config(tmp_path / "run.toml", tiny_model, run_dir, steps, 1),
                                    tmp_path / "coordinator.log")
    wait_for((run_dir / "join.txt").exists, 120, "the join line", [coordinator])
    join = (run_dir / "join.txt").read_text().strip()
    start_node(processes, join, tmp_path, "fast")
    start_node(processes, join, tmp_path, "slow", slow_delay=6.0)
    assert coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]

    records = metrics(run_dir)
    assert [r["version"] for r in records] == list(range(steps))
    # The trainer never trained on anything older than S = 1 ...
    assert all(r["staleness_max"] <= 1 and set(r["staleness_histogram"]) <= {"0", "1"} for r in records)
    assert all(r["mode"] == "async" and r["samples"] == 8 for r in records)
    # ... and the slow node's late batches were dropped and counted against it, not credited.
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    stale = dict(db.execute("SELECT p.name, r.count FROM rejections r JOIN peers p USING (node_id) WHERE r.reason = 'stale'"))
    assert stale.get("slow", 0) > 0
    total_dropped = sum(r["dropped_stale"] for r in records) + sum(r["rejected"] for r in records)
    assert total_dropped > 0
    accepted = dict(db.execute("SELECT name, accepted FROM peers"))
    assert sum(accepted.values()) == 8 * steps  # only what the trainer used is credited


def test_trainer_restart_resumes_version_and_bound(tmp_path, tiny_model, processes):
    run_dir, port = tmp_path / "run", free_port()
    config = async_config(tmp_path / "run.toml", tiny_model, run_dir, 8, 2, port, extra="eval_every = 4\neval_prompts = 4")
    first = start_coordinator(processes, config, tmp_path / "coordinator1.log")
    wait_for((run_dir / "join.txt").exists, 120, "the join line", [first])
    join = (run_dir / "join.txt").read_text().strip()
    nodes = [start_node(processes, join, tmp_path, name) for name in ("n1", "n2")]
    wait_for(lambda: len(metrics(run_dir)) >= 3, 180, "three versions", [first])
    first.send_signal(signal.SIGKILL)  # a crash: no chance to clean up
    first.wait(timeout=30)
    crashed_at = json.loads((run_dir / "state.json").read_text())["version"]
    assert crashed_at >= 3

    second = start_coordinator(processes, config, tmp_path / "coordinator2.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "coordinator2.log").read_text()[-3000:]
    assert "resuming run" in (tmp_path / "coordinator2.log").read_text()
    assert (run_dir / "join.txt").read_text().strip() == join  # same address and key: nodes just reconnect
    records = metrics(run_dir)
    versions = [r["version"] for r in records]
    # Resumed where the checkpoint left off: no version trained twice, none after the crash skipped.
    assert versions == list(range(8))
    assert all(r["staleness_max"] <= 2 for r in records)
    # Evaluation in async mode, across the restart: the rounds open at the crash died with it, the
    # resumed coordinator opens its version's if due, and the last version is evaluated in full;
    # answers are credited apart from trained samples.
    evals = {r["eval_version"]: r for r in metrics(run_dir, evals=True) if r["eval_complete"]}
    assert 8 in evals and evals[8]["eval_samples"] == 4
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    assert sum(n for (n,) in db.execute("SELECT samples FROM evaluations")) >= 4 * len(evals)
    for node in nodes:
        assert node.wait(timeout=60) == 0
    for name in ("n1", "n2"):
        assert "finished at version 8" in (tmp_path / f"{name}.log").read_text()

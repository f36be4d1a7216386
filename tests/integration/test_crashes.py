"""Nothing lost: the coordinator stopped (SIGTERM, SIGINT) and killed (SIGKILL) mid-run, nodes
killed and replaced, and after each the ledger, the journal and metrics.jsonl still agree:
every acknowledged group is trained on exactly once (or still buffered), credited once."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from echo_coordinator.trainer.distributed import free_port
from protocols.supervise import Backoff
from tests.support.runs import (
    async_config, check_books, journal, metrics, spawn, start_coordinator, start_node, wait_for,
)

GROUP, PROMPTS = 4, 2  # async_config's group_size and prompts_per_step; a lease holds one seed


def start_slow_coordinator(processes, config: Path, log: Path, seconds: float, started: Path | None = None):
    """A coordinator whose every step sleeps `seconds`, after creating the file `started`."""
    marks = {"STEP_STARTED": str(started)} if started else {}
    return spawn(processes, [sys.executable, "-m", "tests.support.slow_trainer", "start", "--config", str(config)], log,
                 SLOW_STEP_SECONDS=str(seconds), **marks)


def test_sigterm_mid_step_stops_within_seconds_and_the_restart_trains_what_was_taken(tmp_path, tiny_model, processes):
    # S = 8: nothing goes stale here, so every acknowledged group must be trained on.
    run_dir, port, steps = tmp_path / "run", free_port(), 6
    config = async_config(tmp_path / "run.toml", tiny_model, run_dir, steps, 8, port)
    in_step = tmp_path / "in-a-step"
    first = start_slow_coordinator(processes, config, tmp_path / "coordinator1.log", seconds=60, started=in_step)
    wait_for((run_dir / "join.txt").exists, 120, "the join line", [first])
    join = (run_dir / "join.txt").read_text().strip()
    nodes = [start_node(processes, join, tmp_path, name) for name in ("n1", "n2")]
    # A step has taken its groups and sleeps in the trainer: stop the coordinator now.
    wait_for(lambda: journal(run_dir, "SELECT COUNT(*) FROM buffer WHERE taken_for IS NOT NULL")[0][0] > 0, 120,
             "a step to take its groups", [first])
    wait_for(in_step.exists, 120, "the step on the trainer thread", [first])
    started = time.monotonic()
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    stop_seconds = time.monotonic() - started
    assert stop_seconds < 10, stop_seconds
    print(f"SIGTERM mid-step: exited in {stop_seconds:.1f} s")
    log = (tmp_path / "coordinator1.log").read_text()
    assert "stopped at version 0 (SIGTERM)" in log and "the step in progress is abandoned" in log
    assert metrics(run_dir) == [] and json.loads((run_dir / "state.json").read_text())["version"] == 0
    taken = journal(run_dir, "SELECT COUNT(*) FROM buffer")[0][0]
    assert taken >= PROMPTS

    # A node stopped with Ctrl-C while the coordinator is away leaves within seconds too.
    started = time.monotonic()
    nodes[1].send_signal(signal.SIGINT)
    assert nodes[1].wait(timeout=30) == 0 and time.monotonic() - started < 10
    print(f"node Ctrl-C: exited in {time.monotonic() - started:.1f} s")

    second = start_coordinator(processes, config, tmp_path / "coordinator2.log")
    nodes[1] = start_node(processes, join, tmp_path, "n2")
    assert second.wait(timeout=300) == 0, (tmp_path / "coordinator2.log").read_text()[-3000:]
    assert "resuming run" in (tmp_path / "coordinator2.log").read_text()
    assert [r["version"] for r in metrics(run_dir)] == list(range(steps))
    books = check_books(run_dir)
    assert books["trained"] == steps * PROMPTS * GROUP
    for node in nodes:
        assert node.wait(timeout=60) == 0


def test_sigkill_with_groups_buffered_and_pushes_in_flight(tmp_path, tiny_model, processes):
    """The crash test: SIGKILL while a slow step leaves groups buffered and nodes pushing. The
    restart trains the buffered groups, nodes go on with the leases they held, and the bound
    holds across it (S = 2; what goes stale is dropped and counted)."""
    run_dir, port, steps = tmp_path / "run", free_port(), 8
    config = async_config(tmp_path / "run.toml", tiny_model, run_dir, steps, 2, port, extra="lead_steps = 2")
    first = start_slow_coordinator(processes, config, tmp_path / "coordinator1.log", seconds=2)
    wait_for((run_dir / "join.txt").exists, 120, "the join line", [first])
    join = (run_dir / "join.txt").read_text().strip()
    nodes = [start_node(processes, join, tmp_path, name) for name in ("n1", "n2", "n3")]
    wait_for(lambda: len(metrics(run_dir)) >= 2
             and journal(run_dir, "SELECT COUNT(*) FROM buffer WHERE taken_for IS NULL")[0][0] >= 2, 180,
             "two steps and groups buffered", [first])
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    buffered_at_crash = journal(run_dir, "SELECT lease_id, seed FROM buffer")
    crashed_at = json.loads((run_dir / "state.json").read_text())["version"]
    assert len(buffered_at_crash) >= 2 and crashed_at >= 2

    # The restarted run must outlast a node's longest reconnect wait (`Backoff.cap`): the coordinator
    # exits when the run ends, and a node still waiting then never hears it finished (one did).
    seconds = (Backoff.cap + 5) / (steps - crashed_at)
    second = start_slow_coordinator(processes, config, tmp_path / "coordinator2.log", seconds)
    assert second.wait(timeout=300) == 0, (tmp_path / "coordinator2.log").read_text()[-3000:]
    log = (tmp_path / "coordinator2.log").read_text()
    assert "resuming run" in log and f"at version {crashed_at} (" in log
    records = metrics(run_dir)
    assert [r["version"] for r in records] == list(range(steps))  # none trained twice, none skipped
    assert all(r["staleness_max"] <= 2 for r in records)
    # What was buffered at the crash left the buffer: trained on (credited) or dropped as stale.
    left = set(journal(run_dir, "SELECT lease_id, seed FROM buffer"))
    assert not left & set(buffered_at_crash)
    check_books(run_dir)
    for node in nodes:
        assert node.wait(timeout=60) == 0
    for name in ("n1", "n2", "n3"):
        assert "finished at version 8" in (tmp_path / f"{name}.log").read_text()


def outstanding_holders(run_dir: Path) -> set[str]:
    """Node keys that hold a training lease now, from the journal's copy of the lease book."""
    return {json.loads(lease)[1] for (lease,) in journal(run_dir, "SELECT lease FROM leases")}


def node_key(log: Path) -> str | None:
    text = log.read_text() if log.exists() else ""
    return text.split("(node key ", 1)[1].split(")", 1)[0] if "(node key " in text else None


@pytest.mark.slow
def test_churn_half_the_nodes_killed_mid_rollout_three_times(tmp_path, tiny_model, processes):
    """Async run; three times, SIGKILL half the nodes while they hold leases and start others.
    The run keeps stepping, the dead nodes' leases expire and their seeds go to others, and no
    accepted group is lost or credited twice."""
    run_dir, steps = tmp_path / "run", 150
    config = async_config(tmp_path / "run.toml", tiny_model, run_dir, steps, 2, lease_seconds=6)
    coordinator = start_coordinator(processes, config, tmp_path / "coordinator.log")
    wait_for((run_dir / "join.txt").exists, 120, "the join line", [coordinator])
    join = (run_dir / "join.txt").read_text().strip()
    # Pushes held back 1 s: a node holds its lease a while after generating, so "mid-rollout" is easy to hit.
    live = {name: start_node(processes, join, tmp_path, name, slow_delay=1.0) for name in ("a0", "b0", "c0", "d0")}
    killed: list[str] = []
    for round_ in range(1, 4):
        versions = len(metrics(run_dir))
        wait_for(lambda: len(metrics(run_dir)) >= versions + 2, 180, "two more versions", [coordinator])
        victims = list(live)[:2]  # the longest running

        def holding() -> bool:
            # Keys read at each look: a victim may still be fetching the base model, its key not
            # yet printed (read once, a missing key made this wait fail however long it waited).
            keys = {node_key(tmp_path / f"{name}.log") for name in victims}
            return None not in keys and keys <= outstanding_holders(run_dir)

        wait_for(holding, 60, "the victims holding leases", [coordinator])
        for name in victims:
            live.pop(name).send_signal(signal.SIGKILL)
            killed.append(name)
        for name in victims:
            fresh = f"{name[0]}{round_}"
            live[fresh] = start_node(processes, join, tmp_path, fresh, slow_delay=1.0)
    assert coordinator.wait(timeout=600) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]

    records = metrics(run_dir)
    assert [r["version"] for r in records] == list(range(steps))  # it kept stepping through all of it
    assert sum(r["leases_expired"] for r in records) >= 3  # the dead nodes' leases, reissued to others
    assert all(r["staleness_max"] <= 2 for r in records)
    check_books(run_dir)
    for node in live.values():
        assert node.wait(timeout=60) == 0

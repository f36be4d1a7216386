"""Running real coordinators and nodes in tests: spawning our own processes, waiting for
readiness (never for a fixed time), the run configurations the integration tests share, and
reading back what a run wrote (free ports: `echo_coordinator.trainer.distributed.free_port`). The fixtures built on these are in tests/conftest.py."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]
STEPS = 3
LETTER_E = "tests.support.envs:LetterE"  # a user environment by dotted path that a tiny model can learn


def wait_for(predicate, timeout: float, what: str, procs=()):
    """Poll `predicate` until it holds; fail at once if one of `procs` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"process exited with {p.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def spawn(processes: list, args, log: Path, **extra_env: str) -> subprocess.Popen:
    """Start one of our processes, its output in `log`; `processes` (the fixture) stops it at the end."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **extra_env}
    proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    processes.append(proc)
    return proc


def join_argv(run_dir: Path, coordinator: subprocess.Popen) -> list[str]:
    """Once the coordinator has printed it, the join line as argv: echo-node join ADDR --run-key FP."""
    wait_for((run_dir / "join.txt").exists, 120, "the join line", [coordinator])
    return shlex.split((run_dir / "join.txt").read_text())


def write_config(path: Path, model: Path, data_dir: Path, task: str = LETTER_E, steps: int = STEPS, extra: str = "") -> Path:
    """A sequential run of `steps` on two nodes, 4 prompts x 4 samples of 8 tokens."""
    path.write_text(f"""
[run]
model = "{model}"
task = "{task}"
steps = {steps}
prompts_per_step = 4
group_size = 4
max_new_tokens = 8
min_nodes = 2
port = 0
data_dir = "{data_dir}"
lease_seconds = 60
{extra}

[trainer]
lora_rank = 4
learning_rate = 0.01
micro_batch_tokens = 512
threads = 1
""")
    return path


def async_config(path: Path, model: Path, data_dir: Path, steps: int, staleness: int, port: int = 0, extra: str = "",
                 lease_seconds: float = 120, trainer: str = "") -> Path:
    """An async run on two nodes, 2 prompts x 4 samples of 8 tokens a step; `extra` and `trainer`:
    more lines of [run] and [trainer]."""
    path.write_text(f"""
[run]
model = "{model}"
task = "{LETTER_E}"
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
{trainer}
""")
    return path


def start_coordinator(processes: list, config: Path, log: Path):
    return spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)], log)


def start_node(processes: list, join_line: str, tmp_path: Path, name: str, slow_delay: float | None = None,
               late: tuple[Path, int] | None = None):
    """A node from the join line; with `slow_delay`, one that pushes that many seconds late; with
    `late` (a run's state.json, n), one whose every push waits until that file names a version n
    past the batch's (`tests.support.slow_node`)."""
    argv = shlex.split(join_line)
    args = [*argv[1:], "--name", name, "--data-dir", str(tmp_path / name), "--threads", "1"]
    if slow_delay is None and late is None:
        return spawn(processes, [str(VENV_BIN / "echo-node"), *args], tmp_path / f"{name}.log")
    held = dict(SLOW_NODE_DELAY=str(slow_delay)) if late is None else dict(SLOW_NODE_STATE=str(late[0]),
                                                                           SLOW_NODE_VERSIONS=str(late[1]))
    return spawn(processes, [sys.executable, "-m", "tests.support.slow_node", *args], tmp_path / f"{name}.log", **held)


def metrics(run_dir: Path, evals: bool = False) -> list[dict]:
    """Step records (or, with `evals`, evaluation records) of metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if ("eval_version" in r) == evals]


def journal(run_dir: Path, sql: str) -> list[tuple]:
    """A query on the run's ledger.sqlite (journal tables included), read-only use."""
    db = sqlite3.connect(run_dir / "ledger.sqlite", timeout=10)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def stopped_run(directory: Path, dashboard_url: str, steps: int) -> Path:
    """The directory of a stopped run ("run-2", `steps` steps) whose dashboard once served at
    `dashboard_url`: what `status` reads after another run took that port."""
    from echo_coordinator.ledger import Ledger

    directory.mkdir()
    ledger = Ledger(directory / "ledger.sqlite")
    ledger.set_run(run_id="run-2", mode="sequential", version=0, steps=steps, samples_per_step=4, staleness=1,
                   model="tiny.gguf", task="arithmetic")
    ledger.close()
    (directory / "dashboard.txt").write_text(dashboard_url + "\n")
    return directory


def check_books(run_dir: Path, group: int = 4) -> dict:
    """Every acknowledged group is trained on exactly once or still buffered; what was trained is
    what the ledger credits, step by step. `group`: samples per accepted lease (async_config's
    group_size: a lease holds one seed)."""
    steps = metrics(run_dir)
    trained = sum(r["samples"] for r in steps)
    (accepted_leases,) = journal(run_dir, "SELECT COUNT(*) FROM accepted")[0]
    (buffered,) = journal(run_dir, "SELECT COUNT(*) FROM buffer")[0]
    (credited,) = journal(run_dir, "SELECT COALESCE(SUM(accepted), 0) FROM peers")[0]
    history = dict(journal(run_dir, "SELECT version, SUM(samples) FROM history GROUP BY version"))
    assert credited == trained, (credited, trained)
    assert history == {r["version"] + 1: r["samples"] for r in steps}  # step by step, none twice
    dropped = sum(r["dropped_stale"] for r in steps)
    assert accepted_leases * group == trained + dropped + buffered * group, (accepted_leases, trained, dropped, buffered)
    books = dict(trained=trained, dropped=dropped, buffered=buffered, accepted_leases=accepted_leases,
                 expired=sum(r["leases_expired"] for r in steps), staleness_max=max(r["staleness_max"] for r in steps))
    print(run_dir.parent.name, books)  # pytest -s: the figures for the notes
    return books


def named(*peers: str):
    """A `catch_up`'s `peers`: the coordinator names these holders whatever the version."""
    async def holders(version: int) -> list[str]:
        return list(peers)

    return holders


def quick_bench(bench: str, tmp_path: Path, model: Path) -> dict:
    """`bench/<bench> --quick` on `model`, its runs kept in `tmp_path`, its curves plotted: the
    JSON line it ends with."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / bench), "--quick", "--model", str(model),
                           "--keep", str(tmp_path), "--plot", str(tmp_path / "curves.png")],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    return json.loads(done.stdout.splitlines()[-1])

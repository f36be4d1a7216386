"""Soak test: a coordinator and `--nodes` node processes (tiny random Llama, one thread each) run for
`--minutes` in each mode, and every process of the swarm is watched for leaks and failures.

Every `--sample-seconds` the bench samples the RSS and open file descriptors of the coordinator,
each node and all their descendants (hivemind's `p2pd` daemons included), plus the run's progress
(metrics.jsonl, ledger.sqlite). The first sample is taken once the swarm is up (the coordinator has
published version 1), so start-up growth (imports, model load, first adapter) is not counted; the
run then lasts the full `--minutes` from there (steps = 100000, so it never ends on its own) and
is stopped with SIGTERM (SIGKILL after 20 s). Each mode gets its own fresh coordinator and data dir.

    .venv/bin/python bench/soak.py [--minutes 10] [--nodes 16] [--mode async|sequential|both]
        [--sample-seconds 60] [--keep DIR]
    .venv/bin/python bench/soak.py --minutes 1 --nodes 4      # a quick look

Prints, per mode, a row per sample (max/median RSS over processes, max fds, accepted/rejected
samples, versions) and ends with a JSON line:
  rss_growth_ratio  per process RSS at the last sample / at the first, max over processes and modes
  fd_growth         per process fds at the last sample - at the first, max over processes and modes
  errors            processes that died before the stop + log lines with "Traceback" or " ERROR "
  accepted, rejected, versions   samples credited and refused (ledger), versions published
                    (per mode also `trained`: samples trained on, from metrics.jsonl)
  modes             the same per mode, with the worst process, rejections by reason, orphans
                    (descendants still alive 5 s after their parent stopped; killed by the bench),
                    killed (needed SIGKILL), exit codes
Goal: errors == 0 and rss_growth_ratio <= 1.2 over a 10-minute run with 16 nodes ("ok" in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support: the tiny model and the LetterE task


def write_config(data: Path, model: Path, mode: str, nodes: int) -> Path:
    config = data / "run.toml"
    config.write_text(f"""
[run]
model = "{model}"
task = "tests.support.envs:LetterE"
mode = "{mode}"
staleness = 2
steps = 100000
prompts_per_step = 8
group_size = 4
max_new_tokens = 8
min_nodes = {nodes}
lease_seconds = 60
port = 0
data_dir = "{data}"
eval_every = 0

[trainer]
lora_rank = 4
learning_rate = 0.01
threads = 1
""")
    return config


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def progress(data: Path) -> dict:
    """Versions published (metrics.jsonl) and samples accepted/rejected per node (ledger)."""
    path = data / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines only
    steps = [r for r in map(json.loads, filter(None, lines)) if "eval_version" not in r]
    out = dict(versions=max([r["version"] + 1 for r in steps], default=0), trained=sum(r["samples"] for r in steps),
               accepted=0, rejected=0, rejections={})
    if (data / "ledger.sqlite").exists():
        try:
            db = sqlite3.connect(f"file:{data / 'ledger.sqlite'}?mode=ro", uri=True, timeout=10)
            out["accepted"], out["rejected"] = (n or 0 for n in db.execute("SELECT SUM(accepted), SUM(rejected) FROM peers").fetchone())
            out["rejections"] = dict(db.execute("SELECT reason, SUM(count) FROM rejections GROUP BY reason"))
            db.close()
        except sqlite3.Error as e:  # locked or not created yet: report what metrics say
            print(f"ledger not readable: {e}", file=sys.stderr)
    return out


def sample(procs: dict[str, subprocess.Popen], seen: dict) -> dict[str, tuple[int, int]]:
    """(rss, fds) of each process and its descendants, keyed name/exe:pid; `seen` keeps the handles."""
    out = {}
    for name, popen in procs.items():
        try:
            root = psutil.Process(popen.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in tree:
            try:
                key = name if p.pid == popen.pid else f"{name}/{p.name()}:{p.pid}"
                out[key] = (p.memory_info().rss, p.num_fds())
                seen.setdefault(key, p)
            except psutil.NoSuchProcess:
                pass
    return out


def stop(procs: dict[str, subprocess.Popen], seen: dict) -> tuple[list[str], list[str]]:
    """SIGTERM the nodes, then the coordinator (SIGKILL after 20 s); after 5 s of grace, kill the
    descendants left behind. Returns (the processes that needed SIGKILL, the descendants killed)."""
    killed = []
    for group in ([n for n in procs if n != "coordinator"], ["coordinator"]):
        for name in group:
            if procs[name].poll() is None:
                procs[name].send_signal(signal.SIGTERM)
        for name in group:
            try:
                procs[name].wait(timeout=20)
            except subprocess.TimeoutExpired:
                procs[name].kill()
                procs[name].wait()
                killed.append(name)
    deadline = time.monotonic() + 5
    while (orphans := [k for k, p in seen.items() if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for key in orphans:
        seen[key].kill()
    return killed, orphans


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_mode(mode: str, args, work: Path, model: Path) -> dict:
    data = work / mode
    data.mkdir(parents=True)
    procs = {"coordinator": spawn([sys.executable, "-m", "echo_coordinator.cli", "start", "--config",
                                   str(write_config(data, model, mode, args.nodes)), "--verbose"], data / "coordinator.log")}
    seen, samples = {}, []
    try:
        deadline = time.monotonic() + 300
        while not (data / "join.txt").exists():
            if procs["coordinator"].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{mode}: coordinator did not start; see {data / 'coordinator.log'}")
            time.sleep(0.5)
        argv = shlex.split((data / "join.txt").read_text())
        for i in range(args.nodes):
            procs[f"n{i}"] = spawn([str(BIN / argv[0]), *argv[1:], "--name", f"n{i}", "--data-dir", str(data / f"n{i}"),
                                    "--threads", "1", "--verbose"], data / f"n{i}.log")
        deadline = time.monotonic() + 600
        while progress(data)["versions"] < 1:  # the swarm is up: start-up growth is not counted
            if procs["coordinator"].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{mode}: no version published; see {data / 'coordinator.log'}")
            time.sleep(2)
        start = time.monotonic()
        while True:
            samples.append(dict(t=time.monotonic() - start, procs=sample(procs, seen), **progress(data)))
            s = samples[-1]
            print(f"\r{mode}: {s['t'] / 60:.1f}/{args.minutes} min, {s['versions']} versions", end="", flush=True)
            if s["t"] >= args.minutes * 60 - 1:
                break
            time.sleep(max(0.0, min(args.sample_seconds * len(samples), args.minutes * 60) - (time.monotonic() - start)))
        print()
        died = [n for n, p in procs.items() if p.poll() is not None]
    finally:
        killed, orphans = stop(procs, seen)
    error_lines = sum(("Traceback" in line or " ERROR " in line) for log in data.glob("*.log")
                      for line in log.read_text(errors="replace").splitlines())
    first, last = samples[0]["procs"], samples[-1]["procs"]
    both = [k for k in first if k in last]
    growth = {k: last[k][0] / first[k][0] for k in both}
    worst = max(growth, key=growth.get)
    children = sorted({k.split("/")[1].split(":")[0] for k in last if "/" in k})
    by_kind: dict[str, list[str]] = {}
    for key in both:  # coordinator, node, and their children by program: p2pd, python (the DHT process)
        name, _, child = key.partition("/")
        by_kind.setdefault(("coordinator" if name == "coordinator" else "node") + (f"/{child.split(':')[0]}" if child else ""),
                           []).append(key)
    kinds = {kind: dict(first_mb=round(statistics.median(first[k][0] for k in keys) / 2**20, 1),
                        last_mb=round(statistics.median(last[k][0] for k in keys) / 2**20, 1),
                        growth_max=round(max(growth[k] for k in keys), 3), processes=len(keys))
             for kind, keys in sorted(by_kind.items())}
    return dict(samples=samples, rss_growth_ratio=round(growth[worst], 3), worst_process=worst, rss_by_kind=kinds,
                top_growth={k: [round(first[k][0] / 2**20, 1), round(last[k][0] / 2**20, 1)]  # MB, first and last
                            for k in sorted(growth, key=growth.get, reverse=True)[:3]},
                fd_growth=max(last[k][1] - first[k][1] for k in both), died=died, error_lines=error_lines,
                errors=len(died) + error_lines, killed=killed, orphans=orphans,
                exit_codes={n: p.returncode for n, p in procs.items()}, processes=len(last), children=children, **progress(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--mode", choices=("async", "sequential", "both"), default="both")
    parser.add_argument("--sample-seconds", type=float, default=60)
    parser.add_argument("--keep", default=None, help="keep the run directories (metrics, ledgers, logs) under this one")
    args = parser.parse_args()
    from tests.support.tiny_model import build_tiny_gguf

    modes = ("sequential", "async") if args.mode == "both" else (args.mode,)
    with tempfile.TemporaryDirectory(prefix="echo-soak-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_tiny_gguf(work / "tiny.gguf")
        results = {mode: run_mode(mode, args, work, model) for mode in modes}
    mb = 1 / 2**20
    for mode, r in results.items():
        print(f"\n{mode}: {r['processes']} processes (coordinator, {args.nodes} nodes, children: {', '.join(r['children'])});"
              " RSS in MB over processes")
        print(f"{'min':>6}{'rss max':>10}{'rss med':>10}{'fds max':>9}{'fds med':>9}{'accepted':>10}{'rejected':>10}{'versions':>10}")
        for s in r["samples"]:
            rss, fds = [v[0] * mb for v in s["procs"].values()], [v[1] for v in s["procs"].values()]
            print(f"{s['t'] / 60:6.1f}{max(rss):10.1f}{statistics.median(rss):10.1f}{max(fds):9d}{statistics.median(fds):9.0f}"
                  f"{s['accepted']:10d}{s['rejected']:10d}{s['versions']:10d}")
        print(f"{'process kind':<26}{'first MB':>10}{'last MB':>10}{'growth max':>12}  (medians over processes)")
        for kind, k in r["rss_by_kind"].items():
            print(f"{kind + ' x' + str(k['processes']):<26}{k['first_mb']:10.1f}{k['last_mb']:10.1f}{k['growth_max']:12.3f}")
        print(f"rss growth {r['rss_growth_ratio']} (top, MB first/last: {r['top_growth']}), fd growth {r['fd_growth']}, died {r['died']}, "
              f"error lines {r['error_lines']}, SIGKILLed {r['killed']}, orphans {r['orphans']},\n"
              f"exit codes {r['exit_codes']}, trained samples (metrics) {r['trained']}, rejections {r['rejections']}")
    modes_out = {m: {k: v for k, v in r.items() if k != "samples"} for m, r in results.items()}
    out = dict(rss_growth_ratio=max(r["rss_growth_ratio"] for r in results.values()),
               fd_growth=max(r["fd_growth"] for r in results.values()),
               **{k: sum(r[k] for r in results.values()) for k in ("errors", "accepted", "rejected", "versions")},
               minutes=args.minutes, nodes=args.nodes, modes=modes_out)
    out["ok"] = out["errors"] == 0 and out["rss_growth_ratio"] <= 1.2
    print(json.dumps(out))


if __name__ == "__main__":
    main()

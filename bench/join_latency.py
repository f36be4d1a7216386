"""How long a volunteer waits: seconds from `echo-node join` to its first accepted rollout, with
the model already on disk, on 127.0.0.1.

A real coordinator runs the demo model and task in async mode with work always open (64
prompts a step, so the trainer does not step while we measure and compete for the cores); a
warm-up node starts the run. Then `--trials` fresh nodes (new key and data dir, `--model` the
shipped GGUF) join one after another; each is timed from its process start to the line it prints
on its first accepted rollout, which also names its phases (DHT, manifest, base model, model
load, first lease, generation, push); "start" is the rest: Python and library imports.

    .venv/bin/python bench/join_latency.py [--trials 5] [--threads 2] [--pin]

`--pin`: the coordinator on CPU 0, each timed node on CPU 1 with one thread, as a volunteer on a
machine of its own (one core of this one) joining a coordinator on another.

Ends with a JSON line: `join_to_first_accept_s` (median) and the median of each phase.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_split import pinned  # noqa: E402
from echo_coordinator.main import demo_model_path  # noqa: E402

BIN = Path(sys.executable).parent
ACCEPTED = re.compile(r"first rollout accepted ([\d.]+) s after start \((.*)\)")


def config(directory: Path) -> Path:
    path = directory / "run.toml"
    path.write_text(f"""
[run]
mode = "async"
steps = 1000
prompts_per_step = 64
lead_steps = 100
group_size = 8
max_new_tokens = 32
min_nodes = 1
port = 0
data_dir = "{directory / 'run'}"
dashboard = false

[trainer]
threads = 1
""")
    return path


def join(line: str, directory: Path, name: str, threads: int,
         cpus: set[int] | None = None) -> tuple[float, dict[str, float]]:
    """One node from process start to its first accepted rollout: (seconds, phases); then stopped."""
    argv = shlex.split(line)
    args = [str(BIN / argv[0]), *argv[1:], "--model", str(demo_model_path()), "--name", name,
            "--data-dir", str(directory / name), "--threads", str(threads)]
    started = time.monotonic()
    node = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=pinned(cpus))
    try:
        for text in node.stdout:
            found = ACCEPTED.search(text)
            if found:
                wall = time.monotonic() - started
                phases = {k: float(v) for k, v in re.findall(r"([a-zA-Z ]+?) ([\d.]+) s", found[2])}
                phases = {k.strip(): v for k, v in phases.items()}
                return wall, {"start": wall - float(found[1]), **phases}
        raise SystemExit(f"node {name} exited without an accepted rollout (code {node.wait()})")
    finally:
        node.send_signal(signal.SIGINT)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pin", action="store_true",
                        help="the coordinator and the warm-up node on CPU 0, each timed node (one thread) on CPU 1 "
                             "alone, as on a volunteer's own machine")
    args = parser.parse_args()
    shared, own = ({0}, {1}) if args.pin else (None, None)
    if args.pin:
        args.threads = 1
    with tempfile.TemporaryDirectory(prefix="echo-join-") as tmp:
        work = Path(tmp)
        log = open(work / "coordinator.log", "w")
        coordinator = subprocess.Popen([str(BIN / "echo-coordinator"), "start", "--demo", "--config",
                                        str(config(work)), "--verbose"], stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=pinned(shared))
        try:
            join_file = work / "run" / "join.txt"
            deadline = time.monotonic() + 300
            while not join_file.exists():
                if coordinator.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the coordinator did not start: {(work / 'coordinator.log').read_text()[-2000:]}")
                time.sleep(0.2)
            line = join_file.read_text().strip()
            join(line, work, "warm-up", args.threads, shared)  # starts the run
            trials = []
            for i in range(args.trials):
                wall, phases = join(line, work, f"trial{i}", args.threads, own)
                trials.append((wall, phases))
                print(f"trial {i}: {wall:.2f} s  ({', '.join(f'{k} {v:.2f}' for k, v in phases.items())})", flush=True)
        finally:
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(timeout=60)
            log.close()
    names = list(trials[0][1])
    medians = {k: round(statistics.median(p.get(k, 0.0) for _, p in trials), 2) for k in names}
    total = statistics.median(w for w, _ in trials)
    print(f"\n{'phase':<14}{'median s':>9}")
    for k, v in medians.items():
        print(f"{k:<14}{v:>9.2f}")
    print(f"{'total':<14}{total:>9.2f}")
    print(json.dumps(dict(join_to_first_accept_s=round(total, 2), phases=medians, trials=args.trials,
                          threads=args.threads, pinned=args.pin)))


if __name__ == "__main__":
    main()

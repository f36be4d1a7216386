"""Can two keys that take leases and never answer stall a run? The demo run (SmolLM2-135M,
sequential, 60 s leases, one honest node) twice, side by side: alone, and with two hoarding keys
(`tests/support/hoarders.py`) asking for work as fast as the rate limit lets them from before
the run starts, keeping every lease and pushing nothing.

    .venv/bin/python bench/hoarding.py [--steps 4] [--threads 1] [--attack hoard|fresh|garbage] [--mode async]
        [--keys 2]

`--attack fresh`: the hoarders use a new key for every request, so no lapse ever makes one wait
(issue 36 point 2). `--attack garbage`: instead, two fresh keys at a time that lease and at once
push random maximum-length tokens, to keep the trainer verifying (issue 36 point 3). `--keys`: that
many attacking keys at once instead of two.

Prints each run's step times and ends with a JSON line: `step_ratio` (mean step time with the
attackers ÷ without; goal <= 2, issue 36: <= 1.5), the medians, and what the attackers were answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from echo_coordinator.main import demo_model_path  # noqa: E402
from tests.support.hoarders import Hoarders  # noqa: E402

BIN = Path(sys.executable).parent
DEMO = (ROOT / "echo_coordinator" / "configs" / "demo.toml").read_text()


def config(directory: Path, steps: int, threads: int, mode: str) -> Path:
    """The demo's run, with one node, 60 s leases and no evaluation rounds, in `mode`."""
    run, trainer = DEMO.split("[trainer]")
    for old, new in (("steps = 10", f"steps = {steps}"), ("min_nodes = 2", "min_nodes = 1"),
                     ("eval_every = 2", "eval_every = 0"), ('mode = "sequential"', f'mode = "{mode}"')):
        run = run.replace(old, new)
    path = directory / "run.toml"
    path.write_text(f"""{run}lease_seconds = 60
data_dir = "{directory / 'run'}"
dashboard = false

[trainer]
threads = {threads}{trainer}""")
    return path


def one_run(directory: Path, steps: int, threads: int, attack: str | None, mode: str,
            keys: int = 2) -> tuple[list[float], dict]:
    """Step seconds of one run, and what the hoarders were answered."""
    directory.mkdir()
    log = open(directory / "coordinator.log", "w")
    coordinator = subprocess.Popen([str(BIN / "echo-coordinator"), "start", "--demo", "--config",
                                    str(config(directory, steps, threads, mode))], stdout=log, stderr=subprocess.STDOUT)
    node = None
    try:
        join_file = directory / "run" / "join.txt"
        deadline = time.monotonic() + 300
        while not join_file.exists():
            if coordinator.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the coordinator did not start: {(directory / 'coordinator.log').read_text()[-2000:]}")
            time.sleep(0.2)
        argv = shlex.split(join_file.read_text())
        node = subprocess.Popen([str(BIN / argv[0]), *argv[1:], "--model", str(demo_model_path()), "--name", "honest",
                                 "--data-dir", str(directory / "node"), "--threads", str(threads)],
                                stdout=open(directory / "node.log", "w"), stderr=subprocess.STDOUT)
        hoarders = Hoarders(argv[2], keys, garbage=attack == "garbage", fresh=attack == "fresh")
        if attack:
            asyncio.run(hoarders.run(lambda: coordinator.poll() is not None))
        if coordinator.wait(timeout=60 * 60) != 0:
            raise SystemExit(f"the run failed: {(directory / 'coordinator.log').read_text()[-2000:]}")
    finally:
        for proc in (node, coordinator):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
        log.close()
    metrics = [json.loads(line) for line in (directory / "run" / "metrics.jsonl").read_text().splitlines()]
    return [m["step_seconds"] for m in metrics], dict(hoarders.replies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="the node's and the trainer's")
    parser.add_argument("--attack", choices=("hoard", "fresh", "garbage"), default="hoard")
    parser.add_argument("--mode", choices=("sequential", "async"), default="sequential", help="the run's sync mode")
    parser.add_argument("--keys", type=int, default=2, help="attacking keys at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo-hoard-") as tmp:
        alone, _ = one_run(Path(tmp) / "alone", args.steps, args.threads, None, args.mode)
        hoarded, replies = one_run(Path(tmp) / "hoarded", args.steps, args.threads, args.attack, args.mode, args.keys)
    print(f"\n{'run':<16}{'steps (s)':<40}{'mean':>7}{'median':>8}")
    for name, steps in (("alone", alone), (f"{args.keys} keys, {args.attack}", hoarded)):
        print(f"{name:<16}{' '.join(f'{s:.1f}' for s in steps):<40}{statistics.mean(steps):>7.1f}"
              f"{statistics.median(steps):>8.1f}")
    print(f"the attackers were answered: {replies}")
    print(json.dumps(dict(step_ratio=round(statistics.mean(hoarded) / statistics.mean(alone), 3),
                          median_ratio=round(statistics.median(hoarded) / statistics.median(alone), 3),
                          alone_s=[round(s, 1) for s in alone], hoarded_s=[round(s, 1) for s in hoarded],
                          attack=args.attack, mode=args.mode, keys=args.keys, attackers=replies, steps=args.steps,
                          threads=args.threads)))


if __name__ == "__main__":
    main()

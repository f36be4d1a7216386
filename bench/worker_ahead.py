"""A node's start with llama.cpp's worker started ahead of the join (`worker_process.Spawned`)
against one started once the model is known, side by side.

Each trial is a fresh Python process that does what a node does before its first lease, less
the network: import hivemind and torch (most of a node's DHT phase) and start the worker on the
shipped model. "ahead" starts the worker first, so that its imports and compile overlap ours;
"after" starts it once ours are done, as nodes did before. Trials alternate, on every CPU of
this machine and then on one (a volunteer with one core: nothing can overlap there).

    .venv/bin/python bench/worker_ahead.py [--trials 5]

Prints a table of medians and one JSON line, with `ratio` (after / ahead) per CPU set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_split import pinned  # noqa: E402

TRIAL = """
import sys, time
started = time.perf_counter()
from pathlib import Path
from engines.llama_process import LlamaProcess
from engines.worker_process import Spawned
spawned = Spawned() if sys.argv[1] == "ahead" else None
import protocols.transport.dht  # hivemind, and torch with it
from echo_coordinator.main import demo_model_path
worker = LlamaProcess(Path(demo_model_path()), threads=1, n_ctx=160, spawned=spawned)
print(time.perf_counter() - started)
worker.close()
"""


def trial(how: str, cpus: set[int] | None) -> float:
    done = subprocess.run([sys.executable, "-c", TRIAL, how], capture_output=True, text=True, cwd=ROOT,
                          preexec_fn=pinned(cpus), check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    every = os.sched_getaffinity(0)
    results = {}
    print(f"{'CPUs':<8}{'after s':>9}{'ahead s':>9}{'ratio':>7}")
    for label, cpus in ((f"{len(every)}", None), ("1", {min(every)})):
        seconds = {"after": [], "ahead": []}
        for _ in range(args.trials):
            for how in seconds:
                seconds[how].append(trial(how, cpus))
        after, ahead = (statistics.median(seconds[k]) for k in ("after", "ahead"))
        results[label] = {"after_s": round(after, 3), "ahead_s": round(ahead, 3), "ratio": round(after / ahead, 2)}
        print(f"{label:<8}{after:>9.2f}{ahead:>9.2f}{after / ahead:>7.2f}")
    print(json.dumps({"bench": "worker_ahead", "trials": args.trials, "cpus": results}))


if __name__ == "__main__":
    main()

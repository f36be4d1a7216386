"""The capacity model against real runs: predicted vs measured trainer busy share, 1 and 2 nodes.

For each node count (and mode), a real coordinator on the demo run (SmolLM2-135M-Instruct Q4_1,
one-digit arithmetic, 64 samples a step) and that many real llama.cpp nodes (1 thread each) run
`--steps` steps. After every step the bench reads the dashboard API: the capacity model's
predicted busy share (from the node throughputs and trainer step time it has measured so far)
and the busy share the step actually had (1 - waiting for rollouts / step time). Step 0 is left
out (it includes the nodes' start-up).

    .venv/bin/python bench/capacity.py [--nodes 1,2] [--modes sequential] [--steps 6]

Prints a table (medians over the steps) and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.demo import stop  # noqa: E402

BIN = Path(sys.executable).parent


def get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def one_run(nodes: int, mode: str, steps: int, work: Path) -> list[dict]:
    """Per step after the first: predicted and measured busy share and what the model saw."""
    config = resources.files("echo_coordinator") / "configs" / "demo.toml"
    data = work / f"{mode}-{nodes}"
    children: list[subprocess.Popen] = []
    try:
        children.append(subprocess.Popen(
            [str(BIN / "echo-coordinator"), "start", "--demo", "--config", str(config), "--data-dir", str(data),
             "--mode", mode, "--steps", str(steps), "--min-nodes", str(nodes), "--dashboard-port", "0"],
            stdout=open(work / f"{mode}-{nodes}-coordinator.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT))
        while not (data / "dashboard.txt").exists() or not (data / "join.txt").exists():
            if children[0].poll() is not None:
                raise SystemExit(f"the coordinator exited; see {work}")
            time.sleep(0.5)
        url = (data / "dashboard.txt").read_text().strip()
        argv = shlex.split((data / "join.txt").read_text())
        for i in range(nodes):
            children.append(subprocess.Popen(
                [str(BIN / argv[0]), *argv[1:], "--name", f"n{i}", "--data-dir", str(data / f"n{i}"), "--threads", "1"],
                stdout=open(work / f"{mode}-{nodes}-n{i}.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT))
        rows, seen = [], 0
        while seen < steps and children[0].poll() is None:
            run = get(url + "api/run")
            if run and len(run["history"]) > seen:
                step = run["history"][-1]
                cap = run["capacity"]
                if seen > 0:
                    rows.append(dict(version=step["version"], measured=step["trainer_busy"], predicted=cap["predicted_busy"],
                                     produced=cap["produced"], needed=cap["needed"]))
                    print(f"  {mode} {nodes} node(s) v{step['version']}: measured busy {step['trainer_busy']:.3f}, "
                          f"predicted {cap['predicted_busy']}, produced {cap['produced']:.2f} / needed {cap['needed']:.2f} "
                          "samples/s", flush=True)
                seen = len(run["history"])
            time.sleep(0.5)
        return rows
    finally:
        stop(children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,2")
    parser.add_argument("--modes", default="sequential")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="echo-capacity-"))
    results = []
    for mode in args.modes.split(","):
        for n in (int(x) for x in args.nodes.split(",")):
            rows = one_run(n, mode, args.steps, work)
            predicted = [r["predicted"] for r in rows if r["predicted"] is not None]
            results.append(dict(
                mode=mode, nodes=n, steps=len(rows),
                produced=round(statistics.median(r["produced"] for r in rows), 3) if rows else None,
                needed=round(statistics.median(r["needed"] for r in rows), 3) if rows else None,
                predicted_busy=round(statistics.median(predicted), 3) if predicted else None,
                measured_busy=round(statistics.median(r["measured"] for r in rows), 3) if rows else None,
            ))
    print(f"\n{'mode':<12}{'nodes':>6}{'samples/s':>11}{'needed':>9}{'predicted busy':>16}{'measured busy':>15}{'ratio':>7}")
    for r in results:
        ratio = r["predicted_busy"] / r["measured_busy"] if r["predicted_busy"] and r["measured_busy"] else float("nan")
        print(f"{r['mode']:<12}{r['nodes']:>6}{r['produced']:>11}{r['needed']:>9}{r['predicted_busy']:>16}"
              f"{r['measured_busy']:>15}{ratio:>7.2f}")
    print(f"(logs in {work})")
    print(json.dumps(dict(runs=results)))


if __name__ == "__main__":
    main()

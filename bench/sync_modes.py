"""Sequential pull vs asynchronous push-pull, same model, task, nodes and sample budget, in one run.

The trainer is pinned to CPU 0 and the nodes to the other CPUs (process affinity), so the two
swarms do not steal each other's cores: the separate hardware of the paper, in miniature.

    .venv/bin/python bench/sync_modes.py [--steps 8] [--prompts 4] [--group 8] [--staleness 4] [--model FILE]

Prints a table and a final JSON line:
  throughput_ratio_async_over_sync  trained samples per wall second, async / sync
  busy_sync, busy_async             trainer busy fraction (forward/backward/optimiser time / wall)
  ideal_ratio                       (generation + training) / max(generation, training), from the
                                    sequential run's phases: the most that overlap can give
  reward_ratio_async_over_sync      mean reward over the last quarter of steps, async / sync
  max_staleness_seen, S
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from echo_coordinator.demo import stop  # SIGINT our children, then kill stragglers

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def run_mode(mode: str, args, work: Path, trainer_cpus: set[int], node_cpus: set[int]) -> list[dict]:
    data = work / mode
    data.mkdir(parents=True)
    config = data / "run.toml"
    config.write_text(f"""
[run]
model = "{args.model}"
task = "arithmetic"
task_params = {{ digits = 1 }}
mode = "{mode}"
staleness = {args.staleness}
steps = {args.steps}
prompts_per_step = {args.prompts}
group_size = {args.group}
max_new_tokens = 32
min_nodes = {args.nodes}
port = 0
data_dir = "{data}"
seed = 1

[trainer]
learning_rate = 3e-4
threads = {len(trainer_cpus)}
""")
    children = []

    def spawn(cmd, cpus, log):
        return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    try:
        coordinator = spawn([str(BIN / "echo-coordinator"), "start", "--config", str(config)], trainer_cpus,
                            data / "coordinator.log")
        children.append(coordinator)
        while not (data / "join.txt").exists():
            if coordinator.poll() is not None:
                raise SystemExit(f"{mode}: coordinator exited early; see {data / 'coordinator.log'}")
            time.sleep(0.5)
        argv = shlex.split((data / "join.txt").read_text())
        threads = max(1, len(node_cpus) // args.nodes)
        for i in range(args.nodes):
            children.append(spawn([str(BIN / argv[0]), *argv[1:], "--name", f"n{i}", "--data-dir", str(data / f"n{i}"),
                                   "--threads", str(threads)], node_cpus, data / f"n{i}.log"))
        while coordinator.poll() is None:
            done = len((data / "metrics.jsonl").read_text().splitlines()) if (data / "metrics.jsonl").exists() else 0
            print(f"\r{mode}: {done}/{args.steps} steps", end="", flush=True)
            time.sleep(2)
        print()
        if coordinator.returncode != 0:
            raise SystemExit(f"{mode}: coordinator failed; see {data / 'coordinator.log'}")
    finally:
        stop(children)
    return [json.loads(line) for line in (data / "metrics.jsonl").read_text().splitlines()]


def summarise(records: list[dict]) -> dict:
    # Wall clock from the start of the first step to the end of the last (start-up excluded).
    wall = records[-1]["time"] - (records[0]["time"] - records[0]["step_seconds"])
    samples = sum(r["samples"] for r in records)
    quarter = records[-max(1, len(records) // 4):]
    return dict(
        samples=samples, wall=wall, throughput=samples / wall,
        busy=sum(r["busy_seconds"] for r in records) / wall,
        gen_median=statistics.median(r["wait_seconds"] for r in records),
        train_median=statistics.median(r["busy_seconds"] for r in records),
        reward_last_quarter=statistics.mean(r["reward_mean"] for r in quarter),
        reward_first=records[0]["reward_mean"],
        max_staleness=max(r["staleness_max"] for r in records),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    if not args.model:
        from echo_coordinator.coordinator import demo_model_path

        args.model = str(demo_model_path())
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs at least 2 CPUs: one for the trainer, the rest for the nodes")
    trainer_cpus, node_cpus = {cpus[0]}, set(cpus[1:])
    with tempfile.TemporaryDirectory(prefix="echo-bench-") as tmp:
        results = {mode: summarise(run_mode(mode, args, Path(tmp), trainer_cpus, node_cpus))
                   for mode in ("sequential", "async")}
    sync, asyn = results["sequential"], results["async"]
    print(f"\n{'':24}{'sequential':>12}{'async':>12}")
    for key, fmt in [("samples", "{:.0f}"), ("wall", "{:.1f}s"), ("throughput", "{:.3f}/s"), ("busy", "{:.2f}"),
                     ("gen_median", "{:.1f}s"), ("train_median", "{:.1f}s"), ("reward_first", "{:.3f}"),
                     ("reward_last_quarter", "{:.3f}"), ("max_staleness", "{:.0f}")]:
        print(f"{key:24}{fmt.format(sync[key]):>12}{fmt.format(asyn[key]):>12}")
    gen, train = sync["gen_median"], sync["train_median"]
    print(json.dumps(dict(
        throughput_ratio_async_over_sync=round(asyn["throughput"] / sync["throughput"], 3),
        busy_sync=round(sync["busy"], 3), busy_async=round(asyn["busy"], 3),
        ideal_ratio=round((gen + train) / max(gen, train), 3),
        reward_ratio_async_over_sync=round(asyn["reward_last_quarter"] / max(sync["reward_last_quarter"], 1e-9), 3),
        max_staleness_seen=asyn["max_staleness"], S=args.staleness,
        steps=args.steps, samples_per_step=args.prompts * args.group, nodes=args.nodes, trainer_cpus=len(trainer_cpus),
        node_cpus=len(node_cpus),
    )))


if __name__ == "__main__":
    main()

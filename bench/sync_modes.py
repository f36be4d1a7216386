"""Sequential pull vs asynchronous push-pull, same model, task, nodes and sample budget, in one run,
judged on the held-out accuracy of the trained policy.

The trainer is pinned to CPU 0 and the nodes to the other CPUs (process affinity), so the two
swarms do not steal each other's cores: the separate hardware of the paper, in miniature. Both
runs train the same number of steps of the same size, so an evaluated version has been trained
on the same number of samples in both; the swarm evaluates versions 0, `--eval-every`, ... and
the last on `--eval-prompts` fixed problems, greedy (echo_coordinator.evaluation).

    .venv/bin/python bench/sync_modes.py [--steps 16] [--prompts 4] [--group 8] [--staleness 4]
        [--eval-every 4] [--eval-prompts 48] [--target T] [--quick] [--png FILE] [--keep DIR] [--model FILE]

Prints the held-out accuracy per evaluated version (trained samples, wall seconds) for each mode,
a table, writes both curves to a PNG, and ends with a JSON line:
  eval_ratio_async_over_sync        final held-out accuracy, async / sync (equal trained samples)
  wall_to_target_ratio_async_over_sync  wall seconds until a version reaching the target accuracy
                                    was published, async / sync (null if either never reached it)
  target                            the target: halfway from version 0's accuracy to sequential's final
  eval_sync, eval_async             final held-out accuracies
  staleness_mean_async              mean staleness of the samples async trained on
  throughput_ratio_async_over_sync  trained samples per wall second, async / sync
  busy_sync, busy_async             trainer busy fraction (forward/backward/optimiser time / wall)
  ideal_ratio                       (generation + training) / max(generation, training), from the
                                    sequential run's phases: the most that overlap can give
  reward_ratio_async_over_sync      mean rollout reward over the last quarter of steps, async / sync
                                    (penalises async by construction: its rollouts are older)
  max_staleness_seen, S
  verified_free_share_sync, _async  of the samples trained on, the share verified from the step's own
                                    forward (docs/verification.md); the rest at their push or apart
  verify_over_busy_sync, _async     verification's trainer seconds (pushes and steps) / the steps' busy seconds
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
from echo_coordinator.observe import mean_staleness
from echo_coordinator.plot import plot_comparison, read_metrics

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def run_mode(mode: str, args, work: Path, trainer_cpus: set[int], node_cpus: set[int],
             name: str = "") -> tuple[list[dict], list[dict]]:
    """One swarm run in `work / (name or mode)`: its step and evaluation records. `args` may also
    carry `task`, `task_params` (TOML), `seed`, `lr`, `tokens`, `extra` ([run] lines) and `trainer`
    ([trainer] lines), which bench/learning.py and bench/staleness.py set; the defaults are this bench's."""
    data = work / (name or mode)
    data.mkdir(parents=True)
    config = data / "run.toml"
    config.write_text(f"""
[run]
model = "{args.model}"
task = "{getattr(args, "task", "arithmetic")}"
task_params = {getattr(args, "task_params", "{ digits = 1 }")}
mode = "{mode}"
staleness = {args.staleness}
steps = {args.steps}
prompts_per_step = {args.prompts}
group_size = {args.group}
max_new_tokens = {getattr(args, "tokens", 32)}
min_nodes = {args.nodes}
port = 0
data_dir = "{data}"
seed = {getattr(args, "seed", 1)}
eval_every = {args.eval_every}
eval_prompts = {args.eval_prompts}
{getattr(args, "extra", "")}

[trainer]
learning_rate = {getattr(args, "lr", 3e-4)}
threads = {len(trainer_cpus)}
{getattr(args, "trainer", "")}
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
            done = len(read_metrics(data)[0]) if (data / "metrics.jsonl").exists() else 0
            print(f"\r{name or mode}: {done}/{args.steps} steps", end="", flush=True)
            time.sleep(2)
        print()
        if coordinator.returncode != 0:
            raise SystemExit(f"{mode}: coordinator failed; see {data / 'coordinator.log'}")
    finally:
        stop(children)
    return read_metrics(data)


def curve(records: list[dict], evals: list[dict]) -> dict[str, list[float]]:
    """Held-out accuracy per evaluated version, against the samples trained into it and the wall
    seconds from the first step's start until it was published."""
    start = records[0]["time"] - records[0]["step_seconds"]
    published = {0: start, **{r["version"] + 1: r["time"] for r in records}}
    trained = {v: sum(r["samples"] for r in records if r["version"] < v) for v in published}
    points = sorted((e["eval_version"], e["eval_accuracy"]) for e in evals if e["eval_sampling"] == "greedy")
    return dict(version=[v for v, _ in points], samples=[trained[v] for v, _ in points],
                seconds=[published[v] - start for v, _ in points], accuracy=[a for _, a in points])


def seconds_to(c: dict[str, list[float]], target: float) -> float | None:
    return next((t for t, a in zip(c["seconds"], c["accuracy"]) if a >= target), None)


def summarise(records: list[dict], evals: list[dict]) -> dict:
    # Wall clock from the start of the first step to the end of the last (start-up excluded).
    wall = records[-1]["time"] - (records[0]["time"] - records[0]["step_seconds"])
    samples = sum(r["samples"] for r in records)
    quarter = records[-max(1, len(records) // 4):]
    staleness = [mean_staleness(r.get("staleness_histogram", {})) or 0.0 for r in records]
    return dict(
        curve=curve(records, evals), staleness_mean=statistics.mean(staleness), samples=samples, wall=wall, throughput=samples / wall,
        busy=sum(r["busy_seconds"] for r in records) / wall,
        gen_median=statistics.median(r["wait_seconds"] for r in records),
        train_median=statistics.median(r["busy_seconds"] for r in records),
        reward_last_quarter=statistics.mean(r["reward_mean"] for r in quarter),
        reward_first=records[0]["reward_mean"],
        max_staleness=max(r["staleness_max"] for r in records),
        # of the samples trained on, the share verified from the step's own forward (issue 34 point 4)
        free_share=sum(r.get("verified_free", 0) for r in records) / max(samples, 1),
        verify_over_busy=sum(r["verify_seconds"] for r in records) / sum(r["busy_seconds"] for r in records),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=48)
    parser.add_argument("--target", type=float, default=None, help="held-out accuracy to time (default: halfway "
                        "from version 0's accuracy to sequential's final)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 steps of 2 prompts, 8 evaluation prompts")
    parser.add_argument("--png", default="sync_modes.png", help="where to write the comparison's curves")
    parser.add_argument("--keep", default=None, help="keep both run directories (metrics, ledgers, logs) under this one")
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts, args.eval_every, args.eval_prompts = 4, 2, 2, 8
    if not args.model:
        from echo_coordinator.main import demo_model_path

        args.model = str(demo_model_path())
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs at least 2 CPUs: one for the trainer, the rest for the nodes")
    trainer_cpus, node_cpus = {cpus[0]}, set(cpus[1:])
    with tempfile.TemporaryDirectory(prefix="echo-bench-") as tmp:
        if args.keep:
            tmp = args.keep
        results = {mode: summarise(*run_mode(mode, args, Path(tmp), trainer_cpus, node_cpus))
                   for mode in ("sequential", "async")}
    sync, asyn = results["sequential"], results["async"]
    for mode, r in results.items():
        print(f"\n{mode}: held-out accuracy (greedy, {args.eval_prompts} prompts) per evaluated version")
        c = r["curve"]
        for v, n, t, a in zip(c["version"], c["samples"], c["seconds"], c["accuracy"]):
            print(f"  v{v:<3} {n:5d} samples {t:7.1f} s  {a:.3f}")
    final_sync, final_async = sync["curve"]["accuracy"][-1], asyn["curve"]["accuracy"][-1]
    base = statistics.mean([sync["curve"]["accuracy"][0], asyn["curve"]["accuracy"][0]])
    target = args.target if args.target is not None else base + (final_sync - base) / 2
    to_sync, to_async = seconds_to(sync["curve"], target), seconds_to(asyn["curve"], target)
    print(f"\n{'':24}{'sequential':>12}{'async':>12}")
    for key, fmt in [("samples", "{:.0f}"), ("wall", "{:.1f}s"), ("throughput", "{:.3f}/s"), ("busy", "{:.2f}"),
                     ("gen_median", "{:.1f}s"), ("train_median", "{:.1f}s"), ("reward_first", "{:.3f}"),
                     ("reward_last_quarter", "{:.3f}"), ("staleness_mean", "{:.2f}"), ("max_staleness", "{:.0f}"),
                     ("free_share", "{:.3f}"), ("verify_over_busy", "{:.3f}")]:
        print(f"{key:24}{fmt.format(sync[key]):>12}{fmt.format(asyn[key]):>12}")
    print(f"{'final held-out accuracy':24}{final_sync:>12.3f}{final_async:>12.3f}")
    print(f"{f'seconds to {target:.3f}':24}{str(None if to_sync is None else round(to_sync, 1)):>12}"
          f"{str(None if to_async is None else round(to_async, 1)):>12}")
    png = plot_comparison({m: r["curve"] for m, r in results.items()}, Path(args.png), target)
    print(f"curves: {png}")
    gen, train = sync["gen_median"], sync["train_median"]
    print(json.dumps(dict(
        eval_ratio_async_over_sync=round(final_async / max(final_sync, 1e-9), 3),
        wall_to_target_ratio_async_over_sync=round(to_async / to_sync, 3) if to_sync and to_async is not None else None,
        target=round(target, 3), eval_sync=round(final_sync, 3), eval_async=round(final_async, 3),
        staleness_mean_async=round(asyn["staleness_mean"], 3),
        throughput_ratio_async_over_sync=round(asyn["throughput"] / sync["throughput"], 3),
        busy_sync=round(sync["busy"], 3), busy_async=round(asyn["busy"], 3),
        ideal_ratio=round((gen + train) / max(gen, train), 3),
        reward_ratio_async_over_sync=round(asyn["reward_last_quarter"] / max(sync["reward_last_quarter"], 1e-9), 3),
        max_staleness_seen=asyn["max_staleness"], S=args.staleness,
        verified_free_share_sync=round(sync["free_share"], 3), verified_free_share_async=round(asyn["free_share"], 3),
        verify_over_busy_sync=round(sync["verify_over_busy"], 3), verify_over_busy_async=round(asyn["verify_over_busy"], 3),
        steps=args.steps, samples_per_step=args.prompts * args.group, nodes=args.nodes, trainer_cpus=len(trainer_cpus),
        node_cpus=len(node_cpus), eval_prompts=args.eval_prompts,
    )))


if __name__ == "__main__":
    main()

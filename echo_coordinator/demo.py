"""`make demo`: a coordinator and two local nodes on SmolLM2-135M, a short sequential-pull run,
live progress, and at the end the reward and held-out accuracy per version, with their curves
as a PNG. Every process is ours and is stopped by
PID on the way out, Ctrl-C included.

`make demo TASK=sokoban` (or `python -m echo_coordinator.demo sokoban`) runs the same swarm on
another shipped config, `echo_coordinator/configs/<TASK>.toml`: sokoban, math or kk."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from echo_coordinator.run_dir import RunDir

BIN = Path(sys.executable).parent
NODES = ("alice", "bob")


def main(task: str = "demo") -> int:
    configs = resources.files("echo_coordinator") / "configs"
    config = configs / f"{task}.toml"
    if not config.is_file():
        shipped = sorted(p.name.removesuffix(".toml") for p in configs.iterdir() if p.name.endswith(".toml"))
        print(f"no shipped config {task!r}; choose one of: {', '.join(shipped)}", file=sys.stderr)
        return 2
    data_dir = Path("runs") / time.strftime(f"{task}-%Y%m%d-%H%M%S")
    data_dir.mkdir(parents=True)
    run_dir = RunDir(data_dir)
    started = time.monotonic()
    children: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # progress lines arrive as they happen
    try:
        coordinator = subprocess.Popen(
            [str(BIN / "echo-coordinator"), "start", "--demo", "--config", str(config), "--data-dir", str(data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
        )
        children.append(coordinator)
        join = run_dir.join_file
        full_log = open(run_dir.log("coordinator"), "w")  # everything, for when something goes wrong
        for line in coordinator.stdout:
            show("coordinator", line, full_log)
            if join.exists():
                break
        else:
            return report_exit(coordinator.wait(), run_dir.log("coordinator"))
        argv = shlex.split(join.read_text())
        for name in NODES:
            log = open(run_dir.log(name), "w")
            children.append(subprocess.Popen(
                [str(BIN / argv[0]), *argv[1:], "--name", name, "--data-dir", str(run_dir.node_dir(name)),
                 "--threads", "1"],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            ))
        print(f"started nodes {', '.join(NODES)} (logs in {data_dir})", flush=True)
        for line in coordinator.stdout:
            show("coordinator", line, full_log)
        code = report_exit(coordinator.wait(), run_dir.log("coordinator"))
        if code == 0:
            for node in children[1:]:
                node.wait(timeout=60)  # they leave once told the run is over
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the swarm", flush=True)
        code = 130
    finally:
        stop(children)
    print_rewards(run_dir, time.monotonic() - started)
    return code


def show(who: str, line: str, log) -> None:
    log.write(line)
    log.flush()
    # Keep the run's own progress lines; skip library chatter (progress bars, warnings).
    if any(k in line for k in ("version", "join", "dashboard", "waiting", "loading", "error", "run ")):
        print(f"[{who}] {line.rstrip()}", flush=True)


def report_exit(code: int, log: Path) -> int:
    if code < 0:
        reason = " (killed; SIGKILL often means out of memory: see `dmesg`)" if code == -signal.SIGKILL else ""
        print(f"the coordinator died from signal {-code}{reason}; its log: {log}", flush=True)
        return 1
    if code != 0:
        print(f"the coordinator exited with code {code}; its log: {log}", flush=True)
    return code


def stop(children: list[subprocess.Popen]) -> None:
    for p in children:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in children:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def print_rewards(run_dir: RunDir, seconds: float) -> None:
    """The reward per version, the held-out accuracy where evaluated, and the curves as a PNG."""
    from echo_coordinator.plot import plot_run, read_metrics

    try:
        steps, evals = read_metrics(run_dir.root)
    except FileNotFoundError:
        return
    accuracy = {e["eval_version"]: e["eval_accuracy"] for e in evals if e["eval_sampling"] == "greedy"}
    print(f"\nreward per version ({len(steps)} versions, {seconds / 60:.1f} min wall), held-out accuracy (greedy):")
    for version in range(max([s["version"] for s in steps] + list(accuracy) + [-1]) + 1):
        step = next((s for s in steps if s["version"] == version), None)
        reward = f"reward {step['reward_mean']:.3f} {'#' * round(20 * step['reward_mean']):20}" if step else " " * 34
        held_out = f"  held-out {accuracy[version]:.3f} {'*' * round(20 * accuracy[version])}" if version in accuracy else ""
        print(f"  v{version:<3} {reward}{held_out}")
    if steps:
        print(f"curves: {plot_run(run_dir.root, run_dir.curves)}")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))

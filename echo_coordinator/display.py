"""What the operator sees: on a terminal one live status line (a rich `Status`), in a log file
(or with --verbose) a line per step; and the dashboard, served as a task of the event loop.
Event loop only."""

from __future__ import annotations

import asyncio
import logging
import time

from rich.console import Console

from echo_coordinator.config import RunConfig
from echo_coordinator.ledger import Ledger
from echo_coordinator.run_dir import RunDir
from echo_coordinator.service import RunService

log = logging.getLogger(__name__)
console = Console(soft_wrap=True)


class Display:
    def __init__(self, status=None):
        self.status = status  # rich Status: the live line, or None to print a line per step
        self.last_step: dict = {}  # the last metrics record, for the live line
        self.last_eval: dict = {}  # the last evaluation record, for the live line

    def waiting(self, what: str) -> None:
        """A long wait: on the live line, or a line of its own without one."""
        if self.status is not None:
            self.status.update(what)
        else:
            console.print(what)

    def say(self, line: str) -> None:
        """A line per event, where there is no live line to show it."""
        if self.status is None:
            console.print(line)

    async def show_status(self, service: RunService, steps: int) -> None:
        """Refresh the live line once a second: version, nodes, throughput, the last step."""
        from echo_coordinator.observe import node_rates

        while self.status is not None:
            live, step = service.live(time.time()), self.last_step
            text = (f"version {live['version']}/{steps} · {len(live['nodes'])} nodes · "
                    f"{sum(node_rates(live)):.1f} samples/s · {live['buffered_groups']} groups buffered")
            if step:
                text += (f" · last step: reward {step['reward_mean']:.3f}, train {step['busy_seconds']:.0f} s, "
                         f"waited {step['wait_seconds']:.0f} s")
            if self.last_eval.get("eval_accuracy") is not None:
                text += f" · held-out accuracy {self.last_eval['eval_accuracy']:.3f} (v{self.last_eval['eval_version']})"
            if live["started"]:
                self.status.update(text)
            await asyncio.sleep(1.0)


def start_dashboard(cfg: RunConfig, run_dir: RunDir, ledger: Ledger,
                    service: RunService) -> tuple[asyncio.Task, str] | None:
    """The dashboard server as a task of this loop, and its URL (also in DIR/dashboard.txt)."""
    run_dir.dashboard_file.unlink(missing_ok=True)
    if not cfg.dashboard:
        return None
    from echo_coordinator import web
    from echo_coordinator.observe import RunView

    sock = web.bind(cfg.dashboard_host, cfg.dashboard_port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/"
    if cfg.dashboard_port and port != cfg.dashboard_port:
        log.warning("dashboard port %d is taken (another run?); serving on %d instead", cfg.dashboard_port, port)
    run_dir.dashboard_file.write_text(url + "\n")
    task = asyncio.create_task(web.serve(RunView(run_dir.root, ledger, live=service.live), sock), name="dashboard")
    task.add_done_callback(_report_dashboard_end)
    return task, url


def _report_dashboard_end(task: asyncio.Task) -> None:
    """The dashboard is not the run: if it fails, say why and let the run go on."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the dashboard stopped (the run goes on): %r", task.exception())

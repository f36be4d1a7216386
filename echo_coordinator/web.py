"""The dashboard's HTTP server: the page, a read-only JSON API and Prometheus text.

    GET /                 the dashboard (one page; it polls the API, no reload)
    GET /api/run          the run: version, progress, throughput, capacity, per-step history
    GET /api/peers        every node key: contribution, throughput, lag, rejections, trust
    GET /api/peer-page    one page of them, sorted and filtered (?sort=&order=asc|desc&offset=&limit=&q=)
    GET /api/peers/{id}   one key, with its history step by step
    GET /metrics          Prometheus text exposition

Served by Starlette on uvicorn, inside the coordinator's own asyncio loop: a small, well-kept ASGI
pair whose server runs as one more task of that loop (no second process, nothing to supervise
apart), with sync endpoints run on worker threads so SQLite reads never block the loop; the
Prometheus text comes from prometheus_client, so names and escaping follow its conventions.
Only GET routes exist; it binds 127.0.0.1 unless told otherwise, and answers only requests whose
`Host` names that address (`allowed_hosts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Mapping
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from echo_coordinator.observe import PAGE_MOST, SORTABLE, RunView


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def allowed_hosts(bound: str) -> list[str]:
    """`Host` headers the dashboard answers, given the address it listens on. Bound to one address,
    only that address and loopback names: a web page the user visits can point a name of its own
    at 127.0.0.1 (DNS rebinding) and would read the API otherwise. Bound to every interface, any."""
    return ["*"] if bound in ("0.0.0.0", "::", "") else [bound, *LOOPBACK_NAMES]


def app(view: RunView, hosts: list[str]) -> Starlette:
    page = resources.files("echo_coordinator").joinpath("dashboard.html").read_text(encoding="utf-8")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(view))

    def index(request: Request) -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    def run(request: Request) -> JSONResponse:
        return JSONResponse(view.run())

    def peers(request: Request) -> JSONResponse:
        return JSONResponse(view.peers())

    def peer_page(request: Request) -> JSONResponse:
        try:
            asked = page_query(request.query_params)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return JSONResponse(view.peer_page(**asked))

    def peer(request: Request) -> JSONResponse:
        found = view.peer(request.path_params["node_id"])
        if found is None:
            return JSONResponse({"error": "no such node key in this run's ledger"}, status_code=404)
        return JSONResponse(found)

    def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(routes=[
        Route("/", index), Route("/api/run", run), Route("/api/peers", peers), Route("/api/peer-page", peer_page),
        Route("/api/peers/{node_id}", peer), Route("/metrics", metrics),
    ], middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)])


def page_query(params: Mapping[str, str]) -> dict[str, Any]:
    """`RunView.peer_page`'s arguments from a query string; ValueError says what is wrong."""
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ValueError("order must be asc or desc")
    match = params.get("q", "")
    if len(match) > 100:
        raise ValueError("q (a name or key to find) is at most 100 characters")
    sort = params.get("sort", "accepted")
    if sort not in SORTABLE:
        raise ValueError(f"sort must be one of: {', '.join(SORTABLE)}")
    return dict(sort=sort, descending=order == "desc", match=match, offset=_whole(params, "offset", 0, 0, 10**9),
                limit=_whole(params, "limit", 50, 1, PAGE_MOST))


def _whole(params: Mapping[str, str], name: str, default: int, least: int, most: int) -> int:
    text = params.get(name, str(default))
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and least <= int(text) <= most):
        raise ValueError(f"{name} must be a whole number from {least} to {most}")
    return int(text)


class _Collector:
    """Prometheus families, read from the same `RunView` as the page at each scrape."""

    def __init__(self, view: RunView):
        self.view = view

    def collect(self):
        run, peers = self.view.run(), self.view.peers()
        cap = run["capacity"]
        gauges = {
            "echo_version": ("Policy version the trainer has published", run["version"]),
            "echo_steps_target": ("Steps (versions) the run will publish", run["steps"]),
            "echo_reward_mean": ("Mean reward of the last step's samples", run["reward_mean"]),
            "echo_trainer_busy_ratio": ("Share of the last step the trainer was not waiting for rollouts", run["trainer_busy"]),
            "echo_mismatch_kl": ("Mismatch KL(behaviour || trainer) of the last step", run["mismatch_kl"]),
            "echo_tis_clipped_ratio": ("Share of the last step's tokens at the TIS cap", run["tis_clipped_fraction"]),
            "echo_samples_produced_per_second": ("Samples/s the nodes produce (capacity model)", cap["produced"]),
            "echo_samples_needed_per_second": ("Samples/s that keep the trainer busy (capacity model)", cap["needed"]),
            "echo_peers_active": ("Node keys seen in the last two minutes", run["peers_active"]),
            "echo_eval_accuracy": ("Held-out accuracy of the last evaluated version", run["eval_accuracy"]),
        }
        for name, (doc, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        rejected = CounterMetricFamily("echo_rejected_samples", "Samples refused, by reason", labels=["reason"])
        for reason, count in sorted(run["rejections_by_reason"].items()):
            rejected.add_metric([reason], count)
        yield rejected
        accepted = CounterMetricFamily("echo_peer_accepted_samples", "Samples trained on, per node key",
                                       labels=["node_id", "name"])
        tokens = CounterMetricFamily("echo_peer_tokens", "Generated tokens trained on, per node key",
                                     labels=["node_id", "name"])
        evaluated = CounterMetricFamily("echo_peer_eval_samples", "Held-out evaluation answers accepted, per node key",
                                        labels=["node_id", "name"])
        refused = CounterMetricFamily("echo_peer_rejected_samples", "Samples refused, per node key and reason",
                                      labels=["node_id", "reason"])
        # A series per key that has contributed; keys that were only ever refused (free to make,
        # any number) are in `echo_rejected_samples` alone, or /metrics would grow with each.
        for p in (p for p in peers if p["accepted"] or p["eval_samples"]):
            accepted.add_metric([p["node_id"], p["name"]], p["accepted"])
            tokens.add_metric([p["node_id"], p["name"]], p["tokens"])
            evaluated.add_metric([p["node_id"], p["name"]], p["eval_samples"])
            for reason, count in sorted(p["rejected_by_reason"].items()):
                refused.add_metric([p["node_id"], reason], count)
        yield from (accepted, tokens, evaluated, refused)


def bind(host: str, port: int) -> socket.socket:
    """The dashboard's listening socket, bound before anything is served: on `port`, or on any
    free port if that one is taken (another run on this machine); `getsockname()` tells which."""
    try:
        return _listen(host, port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE or port == 0:
            raise OSError(f"dashboard cannot listen on {host}:{port} ({e.strerror}); "
                          "set --dashboard-port or pass --no-dashboard") from None
    return _listen(host, 0)


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    return sock


async def serve(view: RunView, sock: socket.socket) -> None:
    """Serve on `sock` until cancelled."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield  # the coordinator owns Ctrl-C

    hosts = allowed_hosts(sock.getsockname()[0])
    server = Server(uvicorn.Config(app(view, hosts), log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    running = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        server.should_exit = True  # close connections and the socket, then stop
        await running
        raise
    finally:
        sock.close()

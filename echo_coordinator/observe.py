"""What the dashboard, its JSON API, Prometheus and `echo-coordinator status` show: one reading.

`RunView` reads the run directory (the ledger and metrics.jsonl, so a finished run can be
shown too) and, while the coordinator runs, its live state (`RunService.live`: who is asking
for work, with which backend and version, at what measured throughput). Every number a page
shows comes from here, so the page, the API, `/metrics` and `status` cannot disagree.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from echo_coordinator.capacity import busy_share, plan
from echo_coordinator.config import SHOWN_STABLE_STALENESS
from echo_coordinator.ledger import Ledger
from echo_coordinator.run_dir import RunDir

RECENT_STEPS = 5  # steps the step time and throughput are medians over
ACTIVE_SECONDS = 120.0  # a peer seen within this is active
CHART_POINTS = 500  # per-step history and evaluations sent at most: a long run's charts stay readable
PAGE_MOST = 200  # peers one page of the table holds at most
SHARE_BARS = 8  # peers the contribution chart names; the rest are one bar
FRESH_SECONDS = 1.0  # how long readings on the clock (the API's) share one reading of the live state and peers
# What the peers table can be sorted by: a peer row's keys (text sorts as text, missing values last).
SORTABLE = ("name", "node_id", "backend", "parallel", "share", "accepted", "tokens", "eval_samples",
            "tokens_per_second", "version_lag", "rejected", "abandoned", "trust", "last_seen")


class RunView:
    def __init__(self, data_dir: Path, ledger: Ledger, live: Callable[[float], dict] | None = None):
        self.data_dir, self.ledger, self.live = Path(data_dir), ledger, live
        self._steps: list[dict] = []
        self._evals: list[dict] = []
        self._offset = 0
        self._reading: tuple[float, dict | None, list[dict]] | None = None

    def steps(self) -> list[dict]:
        """metrics.jsonl's step records, read on from where the last call stopped."""
        path = RunDir(self.data_dir).metrics
        if not path.exists():
            return self._steps
        with open(path, "rb") as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a line being written: read it next time
                self._offset += len(line)
                record = json.loads(line)
                (self._evals if "eval_version" in record else self._steps).append(record)
        return self._steps

    def evals(self) -> list[dict]:
        """metrics.jsonl's evaluation records (held-out accuracy per evaluated version)."""
        self.steps()
        return self._evals

    def run(self, now: float | None = None) -> dict[str, Any]:
        now, live, peers = self.read(now)
        info, steps = self.ledger.run(), self.steps()
        version, target = (live or info).get("version", 0), info.get("steps", 0)
        recent = steps[-RECENT_STEPS:]
        cycle = statistics.median(s["step_seconds"] for s in recent) if recent else None
        train = statistics.median(s["step_seconds"] - s["wait_seconds"] for s in recent) if recent else None
        per_step = info.get("samples_per_step", 0)
        capacity = plan(node_rates(live) if live else [], train, per_step, info.get("mode", ""), info.get("staleness", 0),
                        live["update_seconds"] if live else None, cycle)
        rejections = Counter(self.ledger.rejection_totals())
        rejections.update((live or {}).get("unsigned", {}))
        last = steps[-1] if steps else {}
        evals = [e for e in self.evals() if e["eval_complete"]]
        run_state = state(info, live, version, target)
        running = run_state in ("running", "waiting for nodes")  # a stopped run has no ETA and nobody active
        return dict(
            run_id=info.get("run_id"), model=info.get("model"), task=info.get("task"), mode=info.get("mode"),
            staleness=info.get("staleness"), samples_per_step=per_step, steps=target, version=version,
            state=run_state, live=live is not None, resumed_at=info.get("resumed_at"),
            steps_left=max(0, target - version),
            eta_seconds=cycle * max(0, target - version) if cycle and running else None,
            samples_per_second=statistics.median(s["samples"] / s["step_seconds"] for s in recent) if recent else None,
            trainer_busy=busy(last) if last else None, reward_mean=last.get("reward_mean"),
            mismatch_kl=last.get("mismatch_kl"), tis_clipped_fraction=last.get("tis_clipped_fraction"),
            staleness_histogram=last.get("staleness_histogram", {}), rejections_by_reason=dict(rejections),
            staleness_max=last.get("staleness_max"), staleness_shown_stable=SHOWN_STABLE_STALENESS,
            capacity=asdict(capacity),
            peers_active=sum(now - p["last_seen"] < ACTIVE_SECONDS for p in peers) if running else 0,
            history=[dict(version=s["version"], reward_mean=s["reward_mean"], samples=s["samples"], time=s["time"],
                          samples_per_second=s["samples"] / max(s["step_seconds"], 1e-9), trainer_busy=busy(s),
                          mismatch_kl=s.get("mismatch_kl"), tis_clipped_fraction=s.get("tis_clipped_fraction"),
                          staleness_mean=mean_staleness(s.get("staleness_histogram", {})))
                     for s in thin(steps)],
            eval_accuracy=evals[-1]["eval_accuracy"] if evals else None,
            evals=[dict(version=e["eval_version"], accuracy=e["eval_accuracy"], sampling=e["eval_sampling"],
                        samples=e["eval_samples"], time=e["time"]) for e in thin(evals)],
            time=now,
        )

    def read(self, now: float | None = None) -> tuple[float, dict | None, list[dict[str, Any]]]:
        """(now, the live state, the peers). Readings on the clock (`now` None: the API's) share
        one reading for `FRESH_SECONDS`: every open page asks for the run and a page of peers
        every 2 s, and at a thousand volunteers a reading takes the service's lock and a trip to
        the ledger's busy thread for tens of ms."""
        if now is None and self._reading is not None and time.time() - self._reading[0] < FRESH_SECONDS:
            return self._reading
        at = time.time() if now is None else now
        live = self.live(at) if self.live else None
        reading = (at, live, self._peers(at, live))
        if now is None:
            self._reading = reading
        return reading

    def peers(self, now: float | None = None) -> list[dict[str, Any]]:
        """Every key the ledger knows, with what the live service knows of it."""
        return self.read(now)[2]

    def _peers(self, now: float, live: dict | None) -> list[dict[str, Any]]:
        nodes = (live or {}).get("nodes", {})
        version = live["version"] if live else self.ledger.run().get("version", 0)
        rows = self.ledger.peers()
        known = {p["node_id"] for p in rows}
        # A node's ledger row appears with its first credit, when a step that trained on its work
        # ends: until then (a first step takes minutes) a producing node is listed from the live state.
        rows += [producing(n, node) for n, node in nodes.items()
                 if n not in known and node["samples_per_second"] is not None]
        total = sum(p["accepted"] for p in rows) or 1
        out = []
        for p in rows:
            node = nodes.get(p["node_id"], {})
            rate = node.get("samples_per_second")
            per_sample = p["tokens"] / p["accepted"] if p["accepted"] else 0
            out.append(dict(
                p, backend=node.get("backend", ""), hardware=node.get("hardware", ""), parallel=node.get("parallel"),
                share=p["accepted"] / total,
                samples_per_second=rate, tokens_per_second=rate * per_sample if rate is not None else None,
                version_lag=version - node["holds"] if node.get("holds") is not None else None,
                last_seen=max(p["last_seen"], node.get("last_request", 0)),
                banned=p["banned_until"] > now, trust=trust(p, now), abandoned=node.get("abandoned"),
            ))
        return out

    def peer_page(self, sort: str = "accepted", descending: bool = True, offset: int = 0, limit: int = 50,
                  match: str = "", now: float | None = None) -> dict[str, Any]:
        """One page of the peers table, sorted and filtered here: a run of a thousand volunteers
        sends the page its 50 rows, not a thousand."""
        return page(self.peers(now), sort, descending, offset, limit, match)

    def peer(self, node_id: str, now: float | None = None) -> dict[str, Any] | None:
        row = next((p for p in self.peers(now) if p["node_id"] == node_id), None)
        return None if row is None else dict(row, history=self.ledger.history(node_id))


def page(rows: list[dict], sort: str, descending: bool, offset: int, limit: int, match: str) -> dict[str, Any]:
    """Rows whose name or key contains `match` (any case), sorted by `sort` (missing values last
    either way), `limit` from `offset` on; with the count of every row and of the matching ones,
    and the contribution chart's bars (the largest shares of every row, not of the page)."""
    needle = match.casefold()
    found = [p for p in rows if needle in p["name"].casefold() or needle in p["node_id"].casefold()] if needle else rows
    found = sorted(found, key=lambda p: p["node_id"])  # ties keep one order, so pages never overlap
    text = any(isinstance(p[sort], str) for p in found)
    valued = sorted((p for p in found if p[sort] is not None), reverse=descending,
                    key=(lambda p: p[sort].casefold()) if text else (lambda p: p[sort]))
    ordered = valued + [p for p in found if p[sort] is None]
    offset = min(offset, max(0, len(found) - 1) // limit * limit)  # past the end (rows went): the last page
    credited = sorted((p for p in rows if p["accepted"] > 0), key=lambda p: -p["accepted"])
    shares = [dict(name=p["name"], share=p["share"]) for p in credited[:SHARE_BARS]]
    rest = credited[SHARE_BARS:]
    return dict(total=len(rows), matched=len(found), offset=offset, limit=limit, rows=ordered[offset:offset + limit],
                shares=shares, others=dict(peers=len(rest), share=sum(p["share"] for p in rest)))


def thin(points: list, most: int = CHART_POINTS) -> list:
    """At most `most` of `points`, evenly spaced, the last always kept."""
    if len(points) <= most:
        return points
    stride = -(-len(points) // most)
    return points[::-1][::stride][::-1]


def node_rates(live: dict) -> list[float]:
    """The measured throughput (samples/s) of each node that has one: the capacity model's μ_i."""
    return [n["samples_per_second"] for n in live["nodes"].values() if n["samples_per_second"] is not None]


def busy(step: dict) -> float:
    """A metrics.jsonl step's busy share (`capacity.busy_share`; lines of older releases held
    the training compute's share under the same name, so it is computed, not read)."""
    return busy_share(step["step_seconds"], step["wait_seconds"])


def mean_staleness(histogram: dict[str, int]) -> float | None:
    n = sum(histogram.values())
    return sum(int(k) * v for k, v in histogram.items()) / n if n else None


def producing(node_id: str, node: dict) -> dict[str, Any]:
    """A ledger-shaped row for a node with work accepted but not yet credited."""
    return dict(node_id=node_id, peer_id="", name=node["name"], accepted=0, rejected=0, tokens=0,
                first_seen=node["last_request"], last_seen=node["last_request"], verified_batches=0,
                failed_batches=0, banned_until=0, eval_samples=0, rejected_by_reason={})


def state(info: dict, live: dict | None, version: int, target: int) -> str:
    if live is None:
        return "finished" if target and version >= target else "stopped"
    if live["finished"] or (target and version >= target):
        return "finished"
    return "running" if live["started"] else "waiting for nodes"


def trust(peer: dict, now: float) -> str:
    if peer["banned_until"] > now:
        return f"banned {peer['banned_until'] - now:.0f} s"
    if peer["failed_batches"]:
        return f"{peer['failed_batches']} failed, always checked"
    return "verified" if peer["verified_batches"] else "new"

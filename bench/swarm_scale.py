"""How many volunteers one coordinator serves: N simulated volunteers against a coordinator's
network side, over the real transport (docs/scaling.md has the figures).

The coordinator (its own process) is `tests.support.live_service.LiveService` in async mode: the
real `RunService` (leasing, pushes, policing, SQLite ledger and journal), its stream handlers and
relay on a real hivemind DHT peer on 127.0.0.1, the real `Verifier` on the toy model (every
position's logits are fixed: the forward costs nothing, so what is measured is everything but the
model's forward), on one numba thread (see `run_size`). A trainer stand-in takes a step's groups
as soon as they are buffered, verifies the unchecked ones as a step would, credits them
(`commit_step`) and publishes the next version.

Volunteers: `--procs` processes, each with its share of the N node keys spread over libp2p peers
(`--keys-per-peer` keys share one peer: a p2pd daemon per key would not fit this machine), at most
2 calls in flight per peer and RPC (the coordinator's per-peer limit). Each key behaves as an
honest node: it asks for a lease of `--seeds` prompts, samples the toy model with the lease's
noise, signs and pushes, then waits out the rest of its `--period`; on NoWork it takes the version
it is told and asks again after the retry delay; "busy" is asked again as the node does (a push
every `PUSH_BUSY_RETRY` seconds while its lease lasts, other calls with the node's backoff), and a
call whose stream breaks is sent again as the node's is (a lease request or a holders ask once,
`idempotent`; a push while its lease lasts), and counted (`broken_streams`). A
key told of a newer version asks the coordinator once who holds it (`echo.holders`), as a node
does before fetching it (the fetch itself is not played: the toy model has no weights).

    .venv/bin/python bench/swarm_scale.py [--sizes 16,100,300,1000] [--seconds 60] [--warmup 20]
        [--repeat 3] [--memory] [--dashboard] [--join K] [--pin]

Per N, after the warm-up (medians of `--repeat` runs): lease, push and holders latency p50/p99
(the call, not the volunteer's own queue), accepted samples/s against offered, errors by code, the
coordinator's CPU ms per accepted sample and per push, split by component (`bench/cpu_split.py`;
its DHT process and p2pd daemon included), the cores the coordinator and the volunteers used, the
ledger thread's busy share and queue, the coordinator's RSS at the start and end of the measured
window (and each minute of it), each process's event-loop lag and how long lease and push calls waited for a handler thread,
and whether every acknowledged sample was credited or dropped stale, and each key's time from its
first lease request to its first accepted push (the keys start within one period of each other:
a flash crowd of new keys, each verified; `--dashboard`: also the
latency and size of what an open dashboard asks every 2 s; `--join K`: K fresh volunteers join
the running swarm one after another as a node does, each timed to its first accepted push,
`bench/swarm_joiner.py`). The knee is the first
N where accepted/s falls under 90 % of offered or p99 lease latency passes 100 ms. Ends with one
JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import swarm_joiner  # noqa: E402
from bench.cpu_split import pinned  # noqa: E402

GOAL_P99_LEASE_MS = 100.0
GOAL_CPU_MS = 2.0
GRACE = 3.0  # seconds the coordinator keeps serving after the volunteers' last lease
RSS_EVERY = 60.0  # seconds between the coordinator's RSS readings in the measured window


# -- the coordinator ---------------------------------------------------------------------------

async def coordinator(args) -> None:
    import psutil

    from bench.cpu_split import CpuSplit, children, native_threads, own_cpu
    from echo_coordinator.service import LeaseSettings
    from tests.support.live_service import LiveService

    from echo_coordinator import handlers

    handlers.ThreadPoolExecutor = QueueTimed  # the handlers' lease and push pools, their queues timed
    step_groups = max(4, args.nodes * args.seeds // 5)  # a step every ~2 s at one push per 10 s per key
    settings = LeaseSettings(lease_seconds=60, seeds_per_lease=args.seeds, max_ahead=4 * step_groups)
    with tempfile.TemporaryDirectory() as tmp:
        async with LiveService(Path(tmp), mode="async", settings=settings, seeds=0, reach=args.reach) as live:
            live.publish(1)
            dashboard, url = serve_dashboard(live) if args.dashboard else (None, None)
            print(json.dumps(dict(address=live.address, run_id=live.manifest.run_id, run_key=live.fp, dashboard=url)),
                  flush=True)
            args.start = float(await asyncio.to_thread(sys.stdin.readline))  # the driver's, once volunteers start
            split = CpuSplit().start()
            service, proc = live.service, psutil.Process()
            watch = Watch(service)
            ledger_queue = time_ledger_thread(live.ledger)
            measuring, marks, steps = False, {}, 0
            end = args.start + args.warmup + args.seconds
            lags = Sample()
            lagging = asyncio.ensure_future(loop_lag(lags, args.start + args.warmup, end))
            rss_series = []  # (seconds into the measured window, MiB), every RSS_EVERY seconds
            while time.time() < end:
                if measuring and time.time() >= marks["at"] + RSS_EVERY * len(rss_series):
                    rss_series.append((round(time.time() - marks["at"]), round(proc.memory_info().rss / 2**20, 1)))
                if not measuring and time.time() >= args.start + args.warmup:
                    measuring = True
                    split.reset()
                    ledger_queue.clear()
                    watch.lease_seconds.clear()
                    QueueTimed.waits.clear()
                    marks = dict(cpu=own_cpu(), children=children(), rss=proc.memory_info().rss, steps=steps,
                                 acked=watch.acknowledged, at=time.time())
                    if args.memory:
                        tracemalloc.start(4)
                        marks["snapshot"] = tracemalloc.take_snapshot()
                if await asyncio.to_thread(service.buffered_groups) >= step_groups:
                    await step(live, step_groups)
                    steps += 1
                else:
                    await asyncio.sleep(0.05)
            cpu, kids, elapsed = own_cpu() - marks["cpu"], children(), time.time() - marks["at"]
            rss_end = proc.memory_info().rss
            growth = memory_growth(marks["snapshot"], tracemalloc.take_snapshot()) if args.memory else None
            split.stop()
            accepted = watch.acknowledged - marks["acked"]
            ledger_stats = ledger_queue.summary(elapsed)
            took = sorted(watch.lease_seconds) or [0.0]
            lease_service_ms = [1000 * took[int(len(took) * q)] for q in (0.5, 0.99)]
            await lagging
            await asyncio.sleep(GRACE)  # for the pushes still in flight
            # Every push settled, and the new keys' line empty, before the books are read.
            while (watch.pushing or service.pushes.line_bytes) and time.time() < end + GRACE + 60:
                await asyncio.sleep(0.1)
            await step(live, None)  # the rest of the buffer, so that every acknowledged sample is settled
            if dashboard:
                dashboard.cancel()
            kid_cpu = {k: v - marks["children"].get(k, 0.0) for k, v in kids.items()}
            print(json.dumps(dict(
                accepted=accepted, seconds=elapsed, steps=steps - marks["steps"], cpu_s=cpu, children_s=kid_cpu,
                split_s=dict(split.seconds), rss_start=marks["rss"], rss_end=rss_end, rss_mib_series=rss_series,
                acknowledged=watch.acknowledged, native_threads_s=native_threads(), books=books(live), ledger_thread=ledger_stats,
                lease_service_ms=lease_service_ms, memory_growth=growth,
                # percentiles, not the samples: a line past the pipe's 64 KB would block this
                # process, and the service with it, until the driver reads it
                loop_lag_ms=[percentile(lags, q) for q in (50, 99)],
                pool_wait_ms={k: [percentile(v, q) for q in (50, 99)] for k, v in QueueTimed.waits.items()},
                rejections=dict(service.rejection_counts()))), flush=True)


def serve_dashboard(live) -> tuple[asyncio.Task, str]:
    """The run's real dashboard server, as the coordinator runs it (a task of its loop), and its URL."""
    from echo_coordinator import web
    from echo_coordinator.observe import RunView

    sock = web.bind("127.0.0.1", 0)
    view = RunView(live.tmp_path, live.ledger, live=live.service.live)
    return asyncio.ensure_future(web.serve(view, sock)), f"http://127.0.0.1:{sock.getsockname()[1]}/"


def poll_dashboard(url: str, start: float, end: float, out: dict) -> None:
    """What an open dashboard asks every 2 s (/api/run and the peers table's first page), timed
    and weighed from `start` to `end`."""
    import urllib.request

    while time.time() < end:
        began = time.time()
        for name, path in (("run", "api/run"), ("page", "api/peer-page")):
            t = time.perf_counter()
            with urllib.request.urlopen(url + path, timeout=30) as r:
                body = r.read()
            if began >= start:
                out.setdefault(name + "_ms", []).append(1000 * (time.perf_counter() - t))
                out[name + "_kib"] = len(body) / 1024
                if name == "page":
                    out["peers_listed"] = json.loads(body)["total"]
        time.sleep(max(0.0, began + 2.0 - time.time()))


def memory_growth(before, after, top: int = 12) -> list[str]:
    """The allocation sites (call stacks of 4) whose live Python memory grew most between two
    tracemalloc snapshots, as text."""
    stats = after.compare_to(before, "traceback")[:top]
    return [f"{s.size_diff / 2**20:+.1f} MiB in {s.count_diff:+d} blocks: "
            + " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in s.traceback) for s in stats]


async def loop_lag(lags: list, start: float, end: float, period: float = 0.05) -> None:
    """How late this process's event loop wakes a task that sleeps `period`, in ms, from `start`
    to `end`: every stream's reply waits as long for the loop."""
    while time.time() < end:
        asked = time.perf_counter()
        await asyncio.sleep(period)
        if time.time() >= start:
            lags.append(1000 * (time.perf_counter() - asked - period))


class QueueTimed(ThreadPoolExecutor):
    """A thread pool that keeps a sample of how long each call waited for a thread, in ms, by the
    pool's thread name prefix."""
    waits: dict[str, "Sample"] = {}

    def submit(self, fn, /, *args, **kwargs):
        queued, waits = time.perf_counter(), QueueTimed.waits.setdefault(self._thread_name_prefix, Sample())

        def timed():
            waits.append(1000 * (time.perf_counter() - queued))
            return fn(*args, **kwargs)

        return super().submit(timed)


class Sample(list):
    """At most `size` of the values appended, drawn at random from all of them (reservoir
    sampling): the bench's own timings must not grow the coordinator's memory over a long run."""

    def __init__(self, size: int = 20_000):
        super().__init__()
        self.size, self.seen = size, 0

    def append(self, value) -> None:
        self.seen += 1
        if len(self) < self.size:
            super().append(value)
        elif (i := random.randrange(self.seen)) < self.size:
            self[i] = value

    def clear(self) -> None:
        super().clear()
        self.seen = 0


class LedgerTimes:
    """Calls on the ledger's one thread (lease requests wait there for a trust read and the lease
    book's journal write): seconds run per function, a sample of the seconds queued."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.busy, self.waits, self.calls = Counter(), Sample(), 0

    def add(self, what: str, waited: float, ran: float) -> None:
        self.busy[what] += ran
        self.waits.append(waited)
        self.calls += 1

    def summary(self, seconds: float) -> dict:
        waits = sorted(self.waits)
        return dict(busy_share=sum(self.busy.values()) / seconds,
                    wait_p50_ms=1000 * waits[len(waits) // 2] if waits else None,
                    wait_p99_ms=1000 * waits[int(len(waits) * 0.99)] if waits else None,
                    busiest={k: round(v, 2) for k, v in self.busy.most_common(5)}, calls=self.calls)


def time_ledger_thread(ledger) -> LedgerTimes:
    """Time every call on the ledger's one thread."""
    times, submit = LedgerTimes(), ledger.submit

    def timed(fn, *args, **kwargs):
        queued = time.perf_counter()

        def run():
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.add(getattr(fn, "__qualname__", "?"), started - queued, time.perf_counter() - started)

        return submit(run)

    ledger.submit = timed
    return times


class Watch:
    """What the service's handlers do, seen from inside (they look `issue_lease` and the push
    path's `_receive` up at each call): the samples acknowledged so far, and the seconds each
    `issue_lease` took on its lease thread (against the latency a volunteer sees: what the
    service itself costs, and what is queueing before it or after it, for its journal write)."""

    def __init__(self, service):
        self.service, self.receipts, self.lease_seconds = service, 0, Sample()
        self.pushing = 0  # pushes being handled now
        self.lock = threading.Lock()  # push threads count together: `+=` is no atomic step
        lease, push = service.issue_lease, service.pushes._receive

        def timed_lease(*args, **kwargs):
            started = time.perf_counter()
            try:
                return lease(*args, **kwargs)
            finally:
                self.lease_seconds.append(time.perf_counter() - started)

        def counted_push(*args, **kwargs):
            with self.lock:
                self.pushing += 1
            accepted = 0
            try:
                receipt = push(*args, **kwargs)
                accepted = receipt.accepted
                return receipt
            finally:
                with self.lock:
                    self.receipts += accepted
                    self.pushing -= 1

        service.issue_lease, service.pushes._receive = timed_lease, counted_push

    @property
    def acknowledged(self) -> int:
        """Samples the service said it took, each once: a batch sent again after its answer was
        lost (a broken stream) is told again that it was taken, and not taken twice."""
        return self.receipts - self.service.pushes.told_again


async def step(live, groups: int | None) -> None:
    """What the trainer does with a step's groups, less the training: verify the unchecked ones,
    settle, credit, publish the next version."""
    service, verifier = live.service, live.verifier
    version = service.version
    batch = await asyncio.to_thread(service.take_batch, groups)
    verdicts = []
    for u in batch.unchecked:
        reason, _ = await asyncio.to_thread(verifier.judged, u.version, [batch.samples[i] for i in u.samples],
                                            u.seeds())
        verdicts.append((u, reason))
    if verdicts:
        await asyncio.to_thread(service.settle, verdicts)
    await asyncio.to_thread(service.commit_step, version)
    if groups is not None:
        live.publish(version + 1)


def books(live) -> dict:
    """The ledger's credited samples and the buffer's stale drops, to check nothing acknowledged is lost."""
    db = sqlite3.connect(live.tmp_path / "ledger.sqlite")
    try:
        credited = db.execute("SELECT COALESCE(SUM(accepted), 0) FROM peers").fetchone()[0]
        waiting = db.execute("SELECT COALESCE(SUM(count), 0) FROM buffer").fetchone()[0]
    finally:
        db.close()
    return dict(credited=credited, in_buffer=waiting, stale=live.service.buffer.stale_dropped)


# -- the volunteers ------------------------------------------------------------------------------

async def volunteers(args) -> None:
    from bench.cpu_split import children, own_cpu
    from protocols import rpc
    from protocols.errors import ProtocolError, RemoteError, TransportError
    from protocols.messages import HoldersRequest, LeaseRequest, NoWork
    from protocols.multiaddr import peer_of
    from protocols.signing import generate_key, public_bytes, sign_message
    from echo_node.work import PUSH_BUSY_RETRY
    from protocols.supervise import Backoff
    from tests.support.live_service import Peer, sampled_batch

    peers = await Peer.many(args.address, max(1, -(-args.nodes // args.keys_per_peer)))
    gates = {(p.peer_id, r.name): asyncio.Semaphore(2) for p in peers for r in (rpc.LEASE, rpc.PUSH, rpc.HOLDERS)}
    timed = {rpc.LEASE: "lease_ms", rpc.PUSH: "push_ms", rpc.HOLDERS: "holders_ms"}
    coordinator_peer, run_id = peer_of(args.address), args.run_id
    measure_from, end = args.start + args.warmup, args.start + args.warmup + args.seconds
    out = dict(lease_ms=[], push_ms=[], holders_ms=[], holders_named=0, errors=Counter(), acked=0, leased=0,
               nowork=0, acked_total=0, keys_acked=0, busy=0, broken=Counter(), first_accept_s=[])

    async def call(peer, method, payload: bytes, until: float | None = None) -> bytes:
        """One call as a node makes it: "busy" (the peer's calls in flight at the coordinator's
        limit, or new keys' batches being judged) is no verdict, and is asked again; a push
        (`until`: its lease's expiry) at a fixed interval, given up when the lease is over. A
        broken stream (no answer) is counted, and the call made again as the node makes it: a
        lease request or a holders ask once (`idempotent`), a push while its lease lasts."""
        backoff, resent = Backoff(), False
        while True:
            async with gates[peer.peer_id, method.name]:
                started = time.perf_counter()
                try:
                    raw = await peer.endpoint.call_one(coordinator_peer, method, payload)
                except RemoteError as e:
                    if e.code != "busy":
                        raise
                    out["busy"] += time.time() >= measure_from
                    delay = backoff.next() if until is None else PUSH_BUSY_RETRY
                    if until is not None and time.time() + delay >= until:
                        raise
                    await asyncio.sleep(delay)
                    continue
                except TransportError:
                    out["broken"][method.name] += time.time() >= measure_from
                    delay = backoff.next()
                    if (resent if until is None else time.time() + delay >= until):
                        raise
                    resent = True
                    if until is not None:
                        await asyncio.sleep(delay)
                    continue
                if time.time() >= measure_from:
                    out[timed[method]].append(1000 * (time.perf_counter() - started))
                return raw

    async def move_to(peer, version: int) -> None:
        """A node moving to a new version asks once who holds it (the fetch itself is not played)."""
        named = await call(peer, rpc.HOLDERS, HoldersRequest(version))
        # Mostly none: a key asks the moment it hears of a version, before other keys' lease
        # requests say they hold it (a node asks again after the trainer's "busy").
        out["holders_named"] += len(named.peers)

    async def volunteer(i: int) -> None:
        peer, key, version, mine = peers[i % len(peers)], generate_key(), 1, 0
        await asyncio.sleep(max(0.0, args.start - time.time()) + random.uniform(0, args.period))
        asked = time.monotonic()  # its first lease request
        while time.time() < end:
            began, counting = time.monotonic(), time.time() >= measure_from
            try:
                doing = "lease"
                request = sign_message(LeaseRequest(run_id, public_bytes(key), peer.peer_id, f"v{i}", version,
                                                    args.seeds, time.time(), parallel=args.seeds * args.group), key)
                reply = await call(peer, rpc.LEASE, request)
                if isinstance(reply, NoWork):
                    out["nowork"] += counting
                    if reply.latest_version > version:
                        version, doing = reply.latest_version, "holders"
                        await move_to(peer, version)
                    await asyncio.sleep(reply.retry_after)
                    continue
                out["leased"] += counting * len(reply.seeds) * args.group
                doing = "push"
                receipt = await call(peer, rpc.PUSH, sampled_batch(run_id, key, reply).to_wire(), reply.expires_at)
                out["acked"] += counting * receipt.accepted
                out["acked_total"] += receipt.accepted
                if not mine and receipt.accepted > 0:
                    out["keys_acked"] += 1
                    out["first_accept_s"].append(time.monotonic() - asked)
                mine += receipt.accepted
                if receipt.latest_version > version:
                    version, doing = receipt.latest_version, "holders"
                    await move_to(peer, version)
            except (TransportError, ProtocolError) as e:
                out["errors"][f"{doing}: {e.code if isinstance(e, RemoteError) else type(e).__name__}"] += counting
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(max(0.0, began + args.period - time.monotonic()))

    cpu = {}

    async def measure_cpu() -> None:
        await asyncio.sleep(max(0.0, measure_from - time.time()))
        cpu["start"] = own_cpu() + sum(children().values())
        await asyncio.sleep(max(0.0, end - time.time()))
        cpu["end"] = own_cpu() + sum(children().values())

    out["loop_lag_ms"] = []
    await asyncio.gather(measure_cpu(), loop_lag(out["loop_lag_ms"], measure_from, end),
                         *(volunteer(i) for i in range(args.nodes)))
    out["cpu_s"] = cpu["end"] - cpu["start"]  # the volunteers' process and its p2pd daemons, measured window
    await asyncio.gather(*(p.shutdown() for p in peers))
    print(json.dumps(out), flush=True)


# -- the driver --------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else None


def run_size(n: int, args) -> dict:
    here = [sys.executable, __file__]
    common = ["--warmup", str(args.warmup), "--seconds", str(args.seconds), "--seeds", str(args.seeds)]
    # Verification on one numba thread: the toy model's rows are tiny, and numba's OpenMP threads
    # spin-wait after each parallel region for longer than the region takes (measured: ~1 ms of
    # CPU a sample, as large as the transport's). A real model's rows keep them busy instead.
    flags = [f for f in ("--memory", "--dashboard") if getattr(args, f[2:], False)] + ["--reach"] * bool(args.join)
    coord = subprocess.Popen([*here, "_coordinator", "--nodes", str(n), *common, *flags], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, NUMBA_NUM_THREADS="1"),
                             preexec_fn=pinned({0} if args.pin else None))  # (its daemons too)
    hello = json.loads(coord.stdout.readline())
    start = time.time() + 3 + n / 100  # room for the volunteers' p2pd daemons to start
    coord.stdin.write(f"{start}\n")
    coord.stdin.flush()
    common += ["--start", str(start)]
    from tests.support.live_service import GROUP  # noqa: E402

    procs = min(args.procs, n)
    vols = [subprocess.Popen([*here, "_volunteers", "--address", hello["address"], "--run-id", hello["run_id"],
                              "--group", str(GROUP),
                              "--nodes", str(n // procs + (i < n % procs)), "--keys-per-peer", str(args.keys_per_peer),
                              "--period", str(args.period), *common], stdout=subprocess.PIPE, text=True,
                             preexec_fn=pinned({1} if args.pin else None))
            for i in range(procs)]
    dashboard: dict = {}
    poller = threading.Thread(target=poll_dashboard, daemon=True,
                              args=(hello["dashboard"], start + args.warmup, start + args.warmup + args.seconds, dashboard))
    if hello["dashboard"]:
        poller.start()
    joins: dict = {}
    if args.join:
        joining, joins = swarm_joiner.start_probe(hello["address"], hello["run_key"], start + args.warmup,
                                                  start + args.warmup + args.seconds, args.seeds, args.join)
    parts = [json.loads(v.communicate()[0].strip().splitlines()[-1]) for v in vols]
    if poller.is_alive():
        poller.join()  # its last poll, before its figures are read
    if args.join:
        joining.join()
    stats = json.loads(coord.communicate()[0].strip().splitlines()[-1])
    lease_ms = [x for p in parts for x in p["lease_ms"]]
    push_ms = [x for p in parts for x in p["push_ms"]]
    holders_ms = [x for p in parts for x in p["holders_ms"]]
    first = [x for p in parts for x in p["first_accept_s"]]
    errors = sum((Counter(p["errors"]) for p in parts), Counter())
    acked = sum(p["acked"] for p in parts)
    leased = sum(p["leased"] for p in parts)
    accepted = max(stats["accepted"], 1)
    kids, parts_s = stats["children_s"], dict(stats["split_s"])
    cpu_s = stats["cpu_s"] - parts_s.pop("profiler", 0.0)  # the bench's own sampling is not the coordinator's
    parts_s["unattributed"] = max(0.0, cpu_s - sum(parts_s.values()))  # threads Python does not know
    parts_s.update(kids)
    split = {k: 1000 * v / accepted for k, v in sorted(parts_s.items(), key=lambda kv: -kv[1])}
    return dict(
        nodes=n, offered_per_s=n / args.period * GROUP * args.seeds,
        accepted_per_s=stats["accepted"] / stats["seconds"],
        lease_p50_ms=percentile(lease_ms, 50), lease_p99_ms=percentile(lease_ms, 99),
        push_p50_ms=percentile(push_ms, 50), push_p99_ms=percentile(push_ms, 99),
        holders_asks=len(holders_ms), holders_p50_ms=percentile(holders_ms, 50),
        holders_p99_ms=percentile(holders_ms, 99), holders_named=sum(p["holders_named"] for p in parts),
        errors=dict(errors), busy_retries=sum(p["busy"] for p in parts),
        broken_streams=dict(sum((Counter(p["broken"]) for p in parts), Counter())), nowork=sum(p["nowork"] for p in parts),
        acked=acked, leased_samples=leased,
        keys_acked=sum(p["keys_acked"] for p in parts),
        acked_total=sum(p["acked_total"] for p in parts) + sum(j["accepted"] for j in joins.get("joins", [])),
        # the flash crowd: each key's first accepted push after its first lease request (s)
        first_accept_p50_s=percentile(first, 50), first_accept_p99_s=percentile(first, 99),
        first_accept_max_s=max(first, default=None), keys_never_accepted=n - len(first),
        acknowledged=stats["acknowledged"],
        # acknowledged, yet neither credited, dropped as stale nor waiting in the journal
        lost=stats["acknowledged"] - sum(stats["books"].values()),
        cpu_ms_per_sample=1000 * (cpu_s + sum(kids.values())) / accepted, cpu_ms_by_component=split,
        rss_mib_start=stats["rss_start"] / 2**20, rss_mib_end=stats["rss_end"] / 2**20, steps=stats["steps"],
        rss_mib_series=stats["rss_mib_series"],
        memory_growth=stats["memory_growth"],
        books=stats["books"], rejections=stats["rejections"], native_threads_s=stats["native_threads_s"],
        ledger_thread=stats["ledger_thread"], lease_in_service_p50_p99_ms=stats["lease_service_ms"],
        cpu_ms_per_push=1000 * (cpu_s + sum(kids.values())) / max(1, len(push_ms)),
        coordinator_cores=(cpu_s + sum(kids.values())) / stats["seconds"],
        volunteer_cores=sum(p["cpu_s"] for p in parts) / args.seconds,
        pool_wait_ms=stats["pool_wait_ms"],
        # how late each event loop ran its tasks (ms, p50 / p99): a volunteer's lease latency
        # includes its own process's lag, which is the bench's, not the coordinator's
        loop_lag_ms=dict(coordinator=stats["loop_lag_ms"],
                         volunteers=[percentile([x for p in parts for x in p["loop_lag_ms"]], q) for q in (50, 99)]),
        dashboard={k: percentile(v, 50) if isinstance(v, list) else v for k, v in dashboard.items()} | {
            k.replace("_ms", "_p99_ms"): percentile(v, 99) for k, v in dashboard.items() if isinstance(v, list)},
        **(swarm_joiner.summary(joins) if args.join else {}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        role, rest = sys.argv[1], sys.argv[2:]
        p = argparse.ArgumentParser()
        for flag in ("--start", "--warmup", "--seconds", "--period"):
            p.add_argument(flag, type=float, default=10.0)
        for flag in ("--nodes", "--keys-per-peer", "--group", "--seeds"):
            p.add_argument(flag, type=int, default=1)
        p.add_argument("--address")
        p.add_argument("--run-id")
        p.add_argument("--memory", action="store_true")
        p.add_argument("--dashboard", action="store_true")
        p.add_argument("--reach", action="store_true")  # answer `echo.reach`, for `--join`'s volunteers
        args = p.parse_args(rest)
        asyncio.run(coordinator(args) if role == "_coordinator" else volunteers(args))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,100,300,1000")
    p.add_argument("--seconds", type=float, default=60.0, help="measured window per size")
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--period", type=float, default=10.0, help="seconds between one volunteer's pushes")
    p.add_argument("--procs", type=int, default=2, help="volunteer processes")
    p.add_argument("--keys-per-peer", type=int, default=20)
    p.add_argument("--seeds", type=int, default=4, help="prompts a lease asks for (each sampled GROUP=2 times)")
    p.add_argument("--repeat", type=int, default=3, help="runs per size: the table shows medians")
    p.add_argument("--memory", action="store_true",
                   help="trace the coordinator's Python allocations over the measured window (slows it): "
                        "the lines whose memory grew most, in the JSON as memory_growth")
    p.add_argument("--dashboard", action="store_true",
                   help="serve the run's dashboard and ask it what an open page asks every 2 s: "
                        "latency and size of /api/run and /api/peer-page in the JSON")
    p.add_argument("--pin", action="store_true",
                   help="the coordinator on CPU 0 and the volunteers on CPU 1: a core of its own, as on a machine of "
                        "its own, instead of sharing both cores with the volunteers")
    p.add_argument("--join", type=int, default=0, metavar="K",
                   help="K fresh volunteers join one after another in the measured window, each timed from its "
                        "process start to its first accepted push (bench/swarm_joiner.py): join_s and its phases")
    args = p.parse_args()
    rows = [median_row([run_size(int(n), args) for _ in range(args.repeat)]) for n in args.sizes.split(",")]
    print(f"{'N':>6} {'offered/s':>9} {'accepted/s':>10} {'lease p50/p99 ms':>17} {'push p50/p99 ms':>16} "
          f"{'cpu ms/sample':>13} {'cores c+v':>9} {'RSS MiB':>13} errors")
    for r in rows:
        print(f"{r['nodes']:>6} {r['offered_per_s']:>9.1f} {r['accepted_per_s']:>10.1f} "
              f"{r['lease_p50_ms'] or 0:>8.1f}/{r['lease_p99_ms'] or 0:<8.1f} {r['push_p50_ms'] or 0:>7.1f}/"
              f"{r['push_p99_ms'] or 0:<8.1f} {r['cpu_ms_per_sample']:>13.2f} "
              f"{r['coordinator_cores']:>4.2f}+{r['volunteer_cores']:<4.2f} "
              f"{r['rss_mib_start']:>6.0f}->{r['rss_mib_end']:<6.0f} {r['errors'] or ''}")
        print(f"       first accept per key p50/p99/max: {r['first_accept_p50_s'] or 0:.1f}/"
              f"{r['first_accept_p99_s'] or 0:.1f}/{r['first_accept_max_s'] or 0:.1f} s, "
              f"{r['keys_never_accepted']} keys never accepted; broken streams (sent again): "
              f"{r['broken_streams'] or 'none'}")
        parts = r["cpu_ms_by_component"].items()
        print("       cpu ms/sample by component: " + ", ".join(f"{k} {v:.2f}" for k, v in parts))
        if len(r["rss_mib_series"]) > 2:
            print("       coordinator RSS MiB by minute: " + " ".join(f"{mib:.0f}" for _, mib in r["rss_mib_series"]))
        if r.get("join_s") is not None:
            print(f"       join to first accept (median of {r['joins']}): {r['join_s']:.2f} s  ("
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["join_phases"].items()) + ")")
        for line in r["memory_growth"] or ():
            print("       memory grew " + line)
    knee = next((r["nodes"] for r in rows if r["accepted_per_s"] < 0.9 * r["offered_per_s"]
                 or (r["lease_p99_ms"] or 0) > GOAL_P99_LEASE_MS), None)
    goals = dict(p99_lease_ms=GOAL_P99_LEASE_MS, cpu_ms_per_sample=GOAL_CPU_MS)
    print(json.dumps(dict(bench="swarm_scale", knee=knee, goals=goals, rows=rows)))


def median_row(runs: list[dict]) -> dict:
    """Each number the median of the runs' (the first run's for the rest); `runs` keeps the
    latencies and rates of every run."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and all(isinstance(r[key], (int, float)) for r in runs):
            row[key] = statistics.median(r[key] for r in runs)
        elif key == "cpu_ms_by_component":
            row[key] = {k: statistics.median(r[key].get(k, 0.0) for r in runs) for k in value}
    row["lost"] = max(r["lost"] for r in runs)
    row["runs"] = [{k: r[k] for k in ("accepted_per_s", "lease_p99_ms", "push_p99_ms", "cpu_ms_per_sample", "books",
                                      "acknowledged", "errors", "broken_streams")} for r in runs]
    return row


if __name__ == "__main__":
    main()

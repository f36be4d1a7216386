"""One volunteer joining a running swarm, timed: `bench/swarm_scale.py --join K` runs K of these
one after another while its volunteers load the coordinator (and `bench/join_latency.py` times
the rest of a real node's join: loading the model and generating with it).

A fresh process, as a node is, with a new key: the node's own DHT join and reachability check
(`echo_node.presence.Presence.join`), the manifest as the node fetches it
(`echo_node.join.fetch_manifest`), a lease (a NoWork naming a newer version: the holders of that
version are asked once, as a node does before fetching it, and the lease asked again for it),
and a push of the toy model's samples, told "busy" and pushed again as the node does, until
accepted. Prints one JSON line: the seconds each phase took ("start": the Python and library
imports before the first phase, hivemind's among them, which a node imports in its DHT phase),
the total, and the samples accepted.

    .venv/bin/python bench/swarm_joiner.py --address A --run-key K [--seeds 4] [--born T]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def probe(address: str, run_key: str, start: float, end: float, seeds: int, count: int, out: dict) -> None:
    """`count` joiners one after another from `start` (none begun after `end`; none after one
    fails): each one's phases appended to `out["joins"]`, a failure's output to `out["errors"]`."""
    time.sleep(max(0.0, start - time.time()))
    for _ in range(count):
        born = time.time()
        if born >= end:
            return
        done = subprocess.run([sys.executable, __file__, "--address", address, "--run-key", run_key,
                               "--seeds", str(seeds), "--born", str(born)],
                              capture_output=True, text=True, timeout=120)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            out.setdefault("errors", []).append((done.stdout + done.stderr)[-2000:])
            return
        out.setdefault("joins", []).append(json.loads(lines[-1]))


def start_probe(address: str, run_key: str, start: float, end: float, seeds: int,
                count: int) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=probe, args=(address, run_key, start, end, seeds, count, out), daemon=True)
    thread.start()
    return thread, out


def summary(out: dict) -> dict:
    """The median join and phases, for the bench's row."""
    joins = out.get("joins", [])
    phases = {k: round(statistics.median(j["phases"][k] for j in joins), 3) for k in joins[0]["phases"]} if joins else {}
    return dict(joins=len(joins), join_s=round(statistics.median(j["total"] for j in joins), 2) if joins else None,
                join_phases=phases, joins_accepted=sum(j["accepted"] > 0 for j in joins),
                join_errors=out.get("errors", []))


async def join(args) -> dict:
    import tempfile

    from echo_node import join as node_join
    from echo_node.config import NodeConfig
    from echo_node.presence import Presence
    from echo_node.session import Session
    from echo_node.work import PUSH_BUSY_RETRY
    from protocols import rpc
    from protocols.errors import RemoteError
    from protocols.messages import HoldersRequest, LeaseRequest, NoWork
    from protocols.multiaddr import peer_of
    from protocols.signing import sign_message
    from tests.support.live_service import GROUP, sampled_batch

    phases = {"start": time.time() - args.born}
    lap = time.monotonic()

    def mark(name: str) -> None:
        nonlocal lap
        phases[name], lap = time.monotonic() - lap, time.monotonic()

    with tempfile.TemporaryDirectory(prefix="echo-joiner-") as tmp:
        session = Session(NodeConfig(args.address, args.run_key, data_dir=Path(tmp), name="joiner"))
        presence = Presence(session)
        try:
            if not await presence.join():
                raise SystemExit("stopped before joining")
            mark("DHT")
            endpoint = await presence.open_endpoint()
            manifest = await node_join.fetch_manifest(session, presence.dht, endpoint)
            mark("manifest")
            coordinator, version = peer_of(args.address), 0
            while True:
                request = LeaseRequest(manifest.run_id, session.node_key, endpoint.peer_id, session.name, version,
                                       args.seeds, time.time(), parallel=args.seeds * GROUP)
                lease = await endpoint.call_one(coordinator, rpc.LEASE, sign_message(request, session.key),
                                                idempotent=True)
                if not isinstance(lease, NoWork):
                    break
                if lease.latest_version > version:
                    version = lease.latest_version
                    await endpoint.call_one(coordinator, rpc.HOLDERS, HoldersRequest(version))
                else:
                    await asyncio.sleep(lease.retry_after)
            mark("first lease")
            batch = sampled_batch(manifest.run_id, session.key, lease).to_wire()
            while True:
                try:
                    receipt = await endpoint.call_one(coordinator, rpc.PUSH, batch)
                except RemoteError as e:
                    if e.code != "busy" or time.time() + PUSH_BUSY_RETRY >= lease.expires_at:
                        raise
                    await asyncio.sleep(PUSH_BUSY_RETRY)
                    continue
                if receipt.accepted:
                    break
                raise SystemExit(f"push not accepted: {receipt}")
            mark("push")
        finally:
            presence.shutdown()
    return dict(phases={k: round(v, 3) for k, v in phases.items()}, total=round(time.time() - args.born, 3),
                accepted=receipt.accepted)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True)
    p.add_argument("--run-key", required=True)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--born", type=float, default=None, help="when the process was started (time.time())")
    args = p.parse_args()
    args.born = time.time() if args.born is None else args.born
    print(json.dumps(asyncio.run(join(args))), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

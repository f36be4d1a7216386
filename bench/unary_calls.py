"""A small call as a stream of its own against a unary call (`Rpc.unary`), side by side.

Two hivemind daemons on 127.0.0.1, both peers' Python in this process: `--calls` holders-sized
calls, `--parallel` at a time, through `Endpoint.call_one` with the same declaration but for
`unary`, alternating stream and unary rounds (`--rounds` each). Per call: this process's CPU
(caller and server Python), the daemons' CPU, and latency p50 / p99. Medians over the rounds.

    .venv/bin/python bench/unary_calls.py [--calls 3000] [--parallel 20] [--rounds 3]

Prints a table and one JSON line, with `cpu_ratio` (stream / unary, Python and daemons together).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_split import children, own_cpu  # noqa: E402


async def main(args) -> dict:
    from hivemind.p2p import P2P

    from protocols.messages import Holders, HoldersRequest
    from protocols.rpc import Rpc
    from protocols.transport.streams import Endpoint

    unary = Rpc("bench.holders", HoldersRequest, (Holders,), HoldersRequest.MAX_BYTES, 30.0,
                per_peer=args.parallel, unary=True)
    kinds = {"stream": dataclasses.replace(unary, unary=False), "unary": unary}
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=await server.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    serving, calling = Endpoint(server), Endpoint(client)

    async def holders(request: HoldersRequest, peer: str):
        yield Holders((peer,))

    await serving.serve(unary, holders)  # served both ways, as the coordinator serves its unary calls

    async def one_round(rpc: Rpc) -> dict:
        latencies: list[float] = []

        async def caller(calls: int) -> None:
            for _ in range(calls):
                started = time.perf_counter()
                await calling.call_one(serving.peer_id, rpc, HoldersRequest(3))
                latencies.append(time.perf_counter() - started)

        python, daemons, wall = own_cpu(), sum(children().values()), time.perf_counter()
        await asyncio.gather(*(caller(args.calls // args.parallel) for _ in range(args.parallel)))
        n = len(latencies)
        latencies.sort()
        return dict(python_ms=1e3 * (own_cpu() - python) / n, daemons_ms=1e3 * (sum(children().values()) - daemons) / n,
                    p50_ms=1e3 * latencies[n // 2], p99_ms=1e3 * latencies[int(0.99 * n)],
                    calls_per_s=n / (time.perf_counter() - wall))

    try:
        for rpc in kinds.values():
            await calling.call_one(serving.peer_id, rpc, HoldersRequest(3))  # connections up
        rounds: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind, rpc in kinds.items():
                rounds[kind].append(await one_round(rpc))
    finally:
        await client.shutdown()
        await server.shutdown()
    return {kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in rounds.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--parallel", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    result = asyncio.run(main(args))
    print(f"{'':8} {'python ms/call':>15} {'daemons ms/call':>16} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9}")
    for kind, r in result.items():
        print(f"{kind:8} {r['python_ms']:15.3f} {r['daemons_ms']:16.3f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} "
              f"{r['calls_per_s']:9.0f}")
    cpu = {kind: r["python_ms"] + r["daemons_ms"] for kind, r in result.items()}
    print(json.dumps({"bench": "unary_calls", "calls": args.calls, "parallel": args.parallel, "rounds": args.rounds,
                      **{kind: {k: round(v, 3) for k, v in r.items()} for kind, r in result.items()},
                      "cpu_ratio": round(cpu["stream"] / cpu["unary"], 2)}))

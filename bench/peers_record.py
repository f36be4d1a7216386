"""What the run's DHT peers record costs as it fills: every node announces itself there
(`echo_node.presence`), and the coordinator reads it every second (`echo_coordinator.presence`).

Three real DHT processes on 127.0.0.1 (a replica, a writer, a reader). The writer stores
`--entries` validly signed announcements, each under a fresh key (keys are free: a flood and a
large honest swarm look alike), `--concurrency` at a time, with the TTL an attacker would pick
(290 s; honest nodes use 60). After each `--step` entries it times one more store, and the
reader's read and verification of the whole record.

    .venv/bin/python bench/peers_record.py [--entries 1024] [--step 256]

Ends with a JSON line: per size, `store_s` (one store into the record), `read_s` (the reader's
get through its DHT process), `verify_s` (`verified_announcements` on the reader's side) and
`bytes`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocols.messages import PeerAnnouncement, verified_announcements  # noqa: E402
from protocols.signing import fingerprint, generate_key, public_bytes, sign_message  # noqa: E402
from protocols.transport.dht import SwarmDHT, record_key  # noqa: E402
from tests.unit.protocols.factories import peer_id  # noqa: E402

FLOOD_TTL = 290.0  # seconds: under MAX_RECORD_TTL from the time an announcement is signed


def announcement(i: int) -> PeerAnnouncement:
    key = generate_key()
    return sign_message(PeerAnnouncement(peer_id(f"P{i}"), f"volunteer-{i}", "node", "llama_cpp", "ab" * 32, 0, 0.0,
                                         public_bytes(key), time.time(), run_id="run-1"), key)


async def measure(writer: SwarmDHT, reader: SwarmDHT, key: str, entries: int, step: int, concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def store(i: int) -> None:
        async with gate:
            a = announcement(i)
            await writer.put(key, a.to_wire(), FLOOD_TTL, subkey=a.node_id, timeout=120)

    rows, stored = [], 0
    while stored < entries:
        started = time.perf_counter()
        await asyncio.gather(*(store(i) for i in range(stored, stored + step - 1)))
        fill_s = time.perf_counter() - started
        started = time.perf_counter()
        await store(stored + step - 1)
        store_s = time.perf_counter() - started
        stored += step
        started = time.perf_counter()
        record = await reader.get(key, timeout=120) or {}
        read_s = time.perf_counter() - started
        started = time.perf_counter()
        valid = verified_announcements(record, "run-1")
        rows.append(dict(entries=len(record), valid=len(valid), bytes=sum(map(len, record.values())),
                         fill_s=round(fill_s, 1), store_s=round(store_s, 3), read_s=round(read_s, 3),
                         verify_s=round(time.perf_counter() - started, 3)))
        print(f"{rows[-1]['entries']:>8} {rows[-1]['bytes'] / 1024:>8.0f} {fill_s:>8.1f} {store_s:>8.3f} "
              f"{read_s:>8.3f} {rows[-1]['verify_s']:>8.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1024)
    parser.add_argument("--step", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    run_fp = fingerprint(public_bytes(generate_key()))
    replica = SwarmDHT.start("127.0.0.1", 0, run_fingerprint=run_fp)
    writer = SwarmDHT.start("127.0.0.1", 0, replica.addresses(), run_fingerprint=run_fp)
    reader = SwarmDHT.start("127.0.0.1", 0, replica.addresses(), run_fingerprint=run_fp)
    print(f"{'entries':>8} {'KiB':>8} {'fill s':>8} {'store s':>8} {'read s':>8} {'verify s':>8}")
    try:
        rows = asyncio.run(measure(writer, reader, record_key(run_fp, "peers"), args.entries, args.step,
                                   args.concurrency))
    finally:
        for dht in (writer, reader, replica):
            dht.shutdown()
    print(json.dumps({"rows": rows, "step": args.step, "concurrency": args.concurrency}))


if __name__ == "__main__":
    main()

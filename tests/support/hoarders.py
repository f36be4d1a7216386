"""Keys that take leases and never answer: what a peer that wants to stall a run does. They ask
for work as often as the rate limit lets them (so they are there the moment a step opens or a
lease expires), keep every lease and push nothing. Used by the hoarding test and bench."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

from protocols import rpc
from protocols.errors import RemoteError, TransportError
from protocols.messages import LeaseRequest, RunManifest, TaskLease
from protocols.multiaddr import peer_of
from protocols.signing import generate_key, public_bytes, sign_message
from protocols.transport.dht import SwarmDHT
from protocols.wire import decode_one_of


class Hoarders:
    """`keys` hoarding keys on one DHT peer; `replies` counts what they were answered (`lease` or
    a refusal's code), `held` is every lease they got, with when."""

    def __init__(self, address: str, keys: int = 2, interval: float = 0.2):
        self.address, self.interval = address, interval
        self.keys = [generate_key() for _ in range(keys)]
        self.replies: Counter[str] = Counter()
        self.held: list[tuple[float, TaskLease]] = []

    async def run(self, until: Callable[[], bool]) -> None:
        dht = SwarmDHT.start("127.0.0.1", 0, [self.address])
        try:
            endpoint = await dht.endpoint()
            coordinator = peer_of(self.address)
            manifest = RunManifest.from_wire(await endpoint.call_one(coordinator, rpc.MANIFEST, b""))
            while not until():
                for key in self.keys:
                    await self._ask(endpoint, coordinator, manifest, key)
                await asyncio.sleep(self.interval)
        finally:
            dht.shutdown()

    async def _ask(self, endpoint, coordinator: str, manifest: RunManifest, key) -> None:
        request = sign_message(LeaseRequest(manifest.run_id, public_bytes(key), endpoint.peer_id, "hoarder",
                                            0, 64, time.time()), key)
        try:
            reply = decode_one_of(await endpoint.call_one(coordinator, rpc.LEASE, request.to_wire()),
                                  tuple(rpc.LEASE.replies))
        except RemoteError as e:
            self.replies[e.code] += 1
            return
        except TransportError:
            self.replies["unreachable"] += 1
            return
        if isinstance(reply, TaskLease):
            self.held.append((time.time(), reply))
            self.replies["lease"] += 1

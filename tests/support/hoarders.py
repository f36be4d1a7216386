"""Keys that take leases and never answer: what a peer that wants to stall a run does. They ask
for work as often as the rate limit lets them (so they are there the moment a step opens or a
lease expires), keep every lease and push nothing: with the same keys, or (`fresh`) a new key for
every request, so no lapse ever makes one wait. Or (`garbage`) a fresh key each time that pushes
random maximum-length tokens for its lease at once, to keep the trainer verifying.
Used by the hoarding test and bench."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable

from protocols import rpc
from protocols.errors import RemoteError, TransportError
from protocols.messages import LeaseRequest, RolloutBatch, RolloutSample, RunManifest, TaskLease
from protocols.multiaddr import peer_of
from protocols.signing import generate_key, public_bytes, sign_message
from protocols.transport.dht import SwarmDHT


class Hoarders:
    """`keys` hoarding keys on one DHT peer; `replies` counts what they were answered (`lease` or
    a refusal's code), `held` is every lease they got, with when."""

    def __init__(self, address: str, keys: int = 2, interval: float = 0.2, garbage: bool = False,
                 fresh: bool = False):
        self.address, self.interval, self.garbage, self.fresh = address, interval, garbage, fresh
        self.keys = [generate_key() for _ in range(keys)]
        self.replies: Counter[str] = Counter()
        self.held: list[tuple[float, TaskLease]] = []

    async def run(self, until: Callable[[], bool]) -> None:
        dht = SwarmDHT.start("127.0.0.1", 0, [self.address])
        try:
            endpoint = await dht.endpoint()
            coordinator = peer_of(self.address)
            manifest = await endpoint.call_one(coordinator, rpc.MANIFEST)
            while not until():
                if self.garbage:
                    await asyncio.gather(*(self._push_garbage(endpoint, coordinator, manifest) for _ in self.keys))
                else:
                    for key in self.keys:
                        await self._ask(endpoint, coordinator, manifest, generate_key() if self.fresh else key)
                await asyncio.sleep(self.interval)
        finally:
            dht.shutdown()

    async def _push_garbage(self, endpoint, coordinator: str, manifest: RunManifest) -> None:
        key = generate_key()
        lease = await self._ask(endpoint, coordinator, manifest, key)
        if lease is None:
            return
        samples = tuple(RolloutSample(seed, prompt, tuple(random.randrange(100, manifest.vocab_size)
                                                          for _ in range(manifest.max_new_tokens)),
                                      (-1.0,) * manifest.max_new_tokens)
                        for seed, prompt in zip(lease.seeds, lease.prompts) for _ in range(manifest.group_size))
        batch = sign_message(RolloutBatch(manifest.run_id, lease.lease_id, lease.version, public_bytes(key), samples,
                                          created=time.time()), key)
        try:
            await endpoint.call_one(coordinator, rpc.PUSH, batch.to_wire())
            self.replies["push accepted"] += 1
        except RemoteError as e:
            self.replies[f"push {e.code}"] += 1
        except TransportError:
            self.replies["push unreachable"] += 1

    async def _ask(self, endpoint, coordinator: str, manifest: RunManifest, key) -> TaskLease | None:
        request = sign_message(LeaseRequest(manifest.run_id, public_bytes(key), endpoint.peer_id, "hoarder",
                                            0, 64, time.time()), key)
        try:
            reply = await endpoint.call_one(coordinator, rpc.LEASE, request)
        except RemoteError as e:
            self.replies[e.code] += 1
            return None
        except TransportError:
            self.replies["unreachable"] += 1
            return None
        if not isinstance(reply, TaskLease):
            return None
        self.held.append((time.time(), reply))
        self.replies["lease"] += 1
        return reply

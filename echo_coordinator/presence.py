"""The run in the DHT: the manifest record kept alive, and the nodes' announcements read back
(who holds which version, for the relay's upload budget; hardware and liveness, for the
dashboard and the end of the run). One background task of the event loop."""

from __future__ import annotations

import asyncio
import logging
import time

from echo_coordinator.service import RunService
from echo_coordinator.service.policing import relay_holders
from protocols.errors import TransportError
from protocols.messages import RunManifest, verified_announcements
from protocols.supervise import retry

log = logging.getLogger(__name__)

RECORD_TTL = 120.0  # seconds; DHT records are refreshed at a third of this
PEER_REFRESH = 1.0  # seconds between reads of the nodes' announcements (who can relay what)
ANNOUNCED_FRESH = 15.0  # a live node re-announces every 5 s; older announcements are of nodes gone


class Presence:
    def __init__(self, dht, run_fingerprint: str):
        self.dht, self.fp = dht, run_fingerprint
        # libp2p peer id -> version it announced. Replaced whole by the refresh (event loop), read
        # by the relay's budget: a reader sees one reading or the next, never half of one.
        self.peer_versions: dict[str, int] = {}
        self.last_put = -RECORD_TTL  # time.monotonic() of the last manifest put

    def holding(self, version: int) -> int:
        """How many peers announced holding `version` or newer."""
        return sum(held >= version for held in self.peer_versions.values())

    async def refresh(self, manifest: RunManifest, service: RunService) -> None:
        """Keep the manifest record alive and learn who holds which version (the relay's budget
        lets them serve before we do), for as long as the run lasts. A DHT failure is logged and
        retried with backoff."""
        while True:
            await retry(lambda: self._refresh_once(manifest, service), TransportError, wait=_log_failure)
            await asyncio.sleep(PEER_REFRESH)

    async def _refresh_once(self, manifest: RunManifest, service: RunService) -> None:
        from protocols.transport.dht import record_key

        if time.monotonic() - self.last_put > RECORD_TTL / 3:
            await self.dht.put(record_key(self.fp, "manifest"), manifest.to_wire(), RECORD_TTL)
            self.last_put = time.monotonic()
        record = await self.dht.get(record_key(self.fp, "peers"))
        # Off the event loop: a full record (4,096 signed announcements) takes ~0.3 s to verify.
        announced = await asyncio.to_thread(verified_announcements, record, manifest.run_id)
        self.peer_versions = relay_holders(announced, service.talked(), service.version)
        service.note_peers({a.node_id: a.hardware for a in announced},
                           frozenset(a.node_id for a in announced if time.time() - a.time < ANNOUNCED_FRESH))
        service.prune(time.time())


async def _log_failure(error: BaseException, delay: float) -> None:
    log.warning("DHT refresh failed (%s); retrying in %.1f s", error, delay)
    await asyncio.sleep(delay)

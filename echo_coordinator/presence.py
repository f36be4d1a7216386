"""The run in the DHT: the manifest record kept alive; and who holds which version, for the
relay's upload budget, refreshed from what the nodes' lease requests say. One background task
of the event loop. (The nodes' announcements in the DHT's peers record are not read here: their
cost grows with the swarm, a second a read at a thousand nodes; docs/scaling.md.)"""

from __future__ import annotations

import asyncio
import logging
import time

from echo_coordinator.service import RunService
from protocols.errors import TransportError
from protocols.messages import RunManifest
from protocols.supervise import retry

log = logging.getLogger(__name__)

RECORD_TTL = 120.0  # seconds; DHT records are refreshed at a third of this
PEER_REFRESH = 1.0  # seconds between looks at who can relay what


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
        self.peer_versions = service.relay_holders(time.time())
        service.prune(time.time())


async def _log_failure(error: BaseException, delay: float) -> None:
    log.warning("DHT refresh failed (%s); retrying in %.1f s", error, delay)
    await asyncio.sleep(delay)

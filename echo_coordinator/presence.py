"""The run in the DHT: the manifest record kept alive; and who holds which version, refreshed
from what the nodes' lease requests say, for the relay's upload budget and for nodes asking whom
to fetch a version from (`echo.holders`). One background task of the event loop.

Nodes do not announce themselves in the DHT: a peers record with one entry per node cost every
reader megabytes a read at a thousand nodes, and any fresh key could fill it (docs/scaling.md).
Here each node is known by the libp2p peer its signed lease requests came from (the transport
authenticates it), and an answer lists a few holders, not the swarm."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from echo_coordinator.service import RunService
from protocols.errors import TransportError
from protocols.messages import MAX_HOLDERS, Holders, HoldersRequest, RunManifest
from protocols.supervise import retry

log = logging.getLogger(__name__)

RECORD_TTL = 120.0  # seconds; DHT records are refreshed at a third of this
PEER_REFRESH = 1.0  # seconds between looks at who can relay what
MAX_RELAYED = 10_000  # peers remembered as reached through our relay (the oldest are forgotten first)


class Presence:
    def __init__(self, dht, run_fingerprint: str):
        self.dht, self.fp = dht, run_fingerprint
        # libp2p peer id -> version its lease requests said it holds. Replaced whole by the refresh
        # (event loop), read by the relay's budget and `holders`: a reader sees one reading or the
        # next, never half of one.
        self.peer_versions: dict[str, int] = {}
        self.proven: frozenset[str] = frozenset()  # peers whose key had work accepted lately, same refresh
        # Peers our relayed reachability probe reached: others dial them through our relay circuit.
        self.relayed: dict[str, None] = {}
        self.last_put = -RECORD_TTL  # time.monotonic() of the last manifest put

    def holding(self, version: int) -> int:
        """How many peers said they hold `version` or newer."""
        return sum(held >= version for held in self.peer_versions.values())

    def holders(self, request: HoldersRequest, asker: str) -> Holders:
        """Whom `asker` may fetch `request.version` from (`pick_holders`)."""
        return pick_holders(self.peer_versions, self.proven, self.relayed, request.version, asker)

    def reached(self, peer: str, relayed: bool) -> None:
        """Our reachability probe reached `peer`, through our relay or directly."""
        self.relayed.pop(peer, None)
        if relayed:
            self.relayed[peer] = None
            if len(self.relayed) > MAX_RELAYED:
                del self.relayed[next(iter(self.relayed))]

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
        self.peer_versions, self.proven = service.relay_holders(time.time())
        service.prune(time.time())


def pick_holders(versions: dict[str, int], proven: frozenset[str], relayed, version: int, asker: str,
                 rng=random) -> Holders:
    """Up to MAX_HOLDERS peers that hold `version` or later, not `asker`: peers whose key had work
    accepted first, claims of other keys (free to make) only in the places left; each group in
    random order, so that askers spread over the holders. A flood of fresh keys claiming every
    version thus never hides a proven holder, and a silent claimant costs the asker one stall
    (`echo_node.updates.fetch_chunks` draws a few at once and shuns those that failed)."""
    having = [peer for peer, held in versions.items() if held >= version and peer != asker]
    first, rest = [p for p in having if p in proven], [p for p in having if p not in proven]
    chosen = rng.sample(first, min(len(first), MAX_HOLDERS))
    chosen += rng.sample(rest, min(len(rest), MAX_HOLDERS - len(chosen)))
    return Holders(tuple(chosen), tuple(p for p in chosen if p in relayed))


async def _log_failure(error: BaseException, delay: float) -> None:
    log.warning("DHT refresh failed (%s); retrying in %.1f s", error, delay)
    await asyncio.sleep(delay)

"""The node in the swarm: its DHT (joined through the coordinator's address, retried while it
cannot be reached), whether the coordinator can dial it (behind NAT: a DHT client reached
through the coordinator's relay), and its announcement, which peers read to learn who holds
which version; reading theirs tells us the same of them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from echo_node.config import Stopped
from echo_node.session import Session, console
from protocols import rpc
from protocols.errors import ProtocolError, TransportError
from protocols.messages import HARDWARE_CHARS, PeerAnnouncement, ReachReply, ReachRequest, verified_announcements
from protocols.multiaddr import is_loopback, peer_of, tcp_port
from protocols.signing import sign_message
from protocols.supervise import retry

log = logging.getLogger(__name__)

ANNOUNCE_TTL = 60.0  # seconds
PEER_REFRESH = 5.0  # seconds between re-announcing and re-reading peers' versions
CALL_TIMEOUT = 60.0
RELAY_CHECK = 5.0  # seconds between a node's checks that its relay reservation holds (behind NAT)
REACH_TRIES, REACH_RETRY = 4, 1.0  # asks of "can you dial us?" while the answer is unknown, and the first wait


class Presence:
    """Owns the DHT and our endpoint, what we announce (`version`, `relay_addrs`) and what peers
    announced (`peer_versions`). Event-loop side only."""

    def __init__(self, session: Session):
        self.session = session
        self.dht = None  # SwarmDHT, once joined
        self.via_relay: str | None = None  # behind NAT: the coordinator address we hold a relay reservation at
        self.relay_addrs: tuple[str, ...] = ()  # behind NAT: the relay circuit others reach us through
        self.peer_versions: dict[str, int] = {}  # libp2p peer id -> version it announced
        self.version = 0  # the version we announce holding
        self.endpoint = None  # our stream endpoint (see `open_endpoint`), sharing the DHT's daemon
        self.backend = self.base_sha256 = self.run_id = None  # what we announce: see `advertise`
        self._now = asyncio.Event()  # announce and re-read peers now, not at the next refresh

    @property
    def host(self) -> str:
        config = self.session.config
        if config.host is not None:
            return config.host
        return "127.0.0.1" if is_loopback(config.address) else "0.0.0.0"

    @property
    def peers_key(self) -> str:
        from protocols.transport.dht import record_key

        return record_key(self.session.config.run_key, "peers")

    async def join(self) -> bool:
        """Join the DHT; when the coordinator cannot dial us, again as a DHT client that asks the
        coordinator for a relay reservation (`confirm_relay` announces it once it holds). False if
        stopped first. The caller calls `shutdown` however this ends."""
        self.dht = await self._start_dht()
        if self.dht is None:
            return False
        if await self._reachable():
            return True
        console.print("this node cannot be dialled directly (behind NAT or a firewall): it joins as a DHT client "
                      "and is reached through the coordinator's relay")
        self.shutdown()
        self.via_relay = self.session.config.address
        self.dht = await self._start_dht()
        return self.dht is not None

    async def _start_dht(self):
        """The DHT, through the coordinator's address; while it cannot be reached (not started
        yet, restarting) keep trying with backoff and say so. None if stopped meanwhile."""
        from protocols.transport.dht import SwarmDHT

        config = self.session.config

        async def start() -> SwarmDHT:
            # main thread: see SwarmDHT.start
            return SwarmDHT.start(self.host, 0, [config.address], run_fingerprint=config.run_key, relay=self.via_relay)

        if self.session.stopping.is_set():
            return None
        try:
            return await retry(start, TransportError, wait=self.session.pause_or_stop)
        except Stopped:
            return None

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None

    async def _reachable(self) -> bool:
        """Can the coordinator dial us directly? Asked again while it cannot say (its checks are
        queued: `busy`, or no answer in time); still unknown, the answer is no: a node reached
        through the relay works either way, one wrongly taken as reachable serves nobody."""
        for attempt in range(REACH_TRIES):
            if (reachable := await self._reach(relayed=False)) is not None:
                return reachable
            await asyncio.sleep(REACH_RETRY * 2**attempt)
        return False

    async def _reach(self, relayed: bool) -> bool | None:
        """Can the coordinator dial us (directly, or through its relay)? None if it cannot say."""
        endpoint = await self.dht.endpoint()
        ports = [tcp_port(a) for a in self.dht.addresses() if "/tcp/" in a]
        try:
            raw = await endpoint.call_one(peer_of(self.session.config.address), rpc.REACH,
                                          ReachRequest(ports[0], relayed).to_wire(), timeout=CALL_TIMEOUT)
            return ReachReply.from_wire(raw).reachable
        except (TransportError, ProtocolError, IndexError) as e:
            log.info("reachability check: %s", e)
            return None

    async def confirm_relay(self) -> None:
        """Behind NAT: until the coordinator can dial us through its relay, ask again now and then;
        then announce the circuit, so that peers can fetch from us. libp2p reserves at the
        coordinator, our one static relay, within seconds; meanwhile the node works as usual
        (everything it does, it dials out for). A periodic probe, not a retry: "not yet" is an
        answer, not a failure."""
        started = time.monotonic()
        while not self.session.stopping.is_set():
            if await self._reach(relayed=True):
                self.relay_addrs = (f"{self.via_relay}/p2p-circuit",)
                self._now.set()
                console.print(f"reachable through the relay at {self.via_relay} "
                              f"(after {time.monotonic() - started:.0f} s)")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.session.stopping.wait(), RELAY_CHECK)

    async def open_endpoint(self):
        """The endpoint every call and every handler of this node goes through."""
        self.endpoint = await self.dht.endpoint()
        return self.endpoint

    def advertise(self, backend, base_sha256: str, run_id: str) -> None:
        """What our announcements say from now on: our backend, base model and run."""
        self.backend, self.base_sha256, self.run_id = backend, base_sha256, run_id

    def holding(self, version: int) -> None:
        """We hold `version` now: announce it at once, so peers fetch it from us."""
        self.version = version
        self._now.set()

    def refresh(self) -> None:
        """Re-read who holds what now (the trainer sent its copy on: a peer has it)."""
        self._now.set()

    async def announce(self) -> None:
        """Keep our announcement fresh (at once when asked to) and learn which peers hold which
        version, for the relay. Runs until cancelled."""
        while not self.session.stopping.is_set():
            try:
                await self.dht.put(self.peers_key, self._announcement().to_wire(), ANNOUNCE_TTL,
                                   subkey=self.session.fingerprint)
                announced = await self._announced()
                self.peer_versions = {a.peer_id: a.version for a in announced}
                self.endpoint.learn_relays(announced, self.session.config.address)
            except TransportError as e:
                log.warning("announcing failed, will retry: %s", e)
            self._now.clear()
            try:
                async with asyncio.timeout(PEER_REFRESH):
                    await self._now.wait()
            except TimeoutError:
                pass

    async def withdraw(self) -> None:
        """A signed "left" announcement, which outlives the live one (the DHT keeps the later expiry)."""
        try:
            await self.dht.put(self.peers_key, self._announcement(left=True).to_wire(), ANNOUNCE_TTL * 2,
                               subkey=self.session.fingerprint, timeout=2.0)
        except TransportError as e:
            log.warning("could not withdraw the announcement: %s", e)

    def _announcement(self, left: bool = False) -> PeerAnnouncement:
        s = self.session
        return sign_message(PeerAnnouncement(
            peer_id=self.endpoint.peer_id, name=s.name, role="node", backend=self.backend.name,
            model_sha256=self.base_sha256, version=self.version, throughput=self.backend.throughput,
            public_key=s.node_key, time=time.time(), left=left, hardware=self.backend.hardware[:HARDWARE_CHARS],
            relay_addrs=self.relay_addrs, run_id=self.run_id or "",
        ), s.key)

    def peers_holding(self, version: int) -> list[str]:
        """Peers that announced holding `version` or later (not us)."""
        return [peer for peer, held in self.peer_versions.items() if held >= version and peer != self.endpoint.peer_id]

    async def _announced(self) -> list:
        """The run's verified announcements; verified off the event loop (a full record of 4,096
        takes ~0.3 s)."""
        return await asyncio.to_thread(verified_announcements, await self.dht.get(self.peers_key), self.run_id)

    async def holders(self, sha256: str) -> list[str]:
        """Peers announcing the base model `sha256` (claims: `updates.fetch_chunks` draws from them)."""
        try:
            announced = await self._announced()
        except TransportError:
            return []
        self.endpoint.learn_relays(announced, self.session.config.address)  # the whole set, as `announce` does
        return [a.peer_id for a in announced if a.model_sha256 == sha256]

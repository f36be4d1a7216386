"""The node in the swarm: its DHT (joined through the coordinator's address, retried while it
cannot be reached), whether the coordinator can dial it (behind NAT: a DHT client reached
through the coordinator's relay), and whom to fetch a version from: the coordinator names a few
holders (`echo.holders`), known from their lease requests. The node announces nothing in the
DHT: the version it holds travels in its lease requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from echo_node.config import Stopped
from echo_node.session import Session, console
from protocols import rpc
from protocols.errors import ProtocolError, TransportError
from protocols.messages import HoldersRequest, ReachRequest
from protocols.multiaddr import is_loopback, peer_of, tcp_port
from protocols.supervise import retry

log = logging.getLogger(__name__)

CALL_TIMEOUT = 30.0
MAX_ASKED = 16  # versions whose holders are remembered at once (a chain of deltas asks for each)
RELAY_CHECK = 5.0  # seconds between a node's checks that its relay reservation holds (behind NAT)
REACH_TRIES, REACH_RETRY = 4, 1.0  # asks of "can you dial us?" while the answer is unknown, and the first wait


class Presence:
    """Owns the DHT and our endpoint, and who the coordinator said holds which version. Event-loop
    side only."""

    def __init__(self, session: Session):
        self.session = session
        self.dht = None  # SwarmDHT, once joined
        self.via_relay: str | None = None  # behind NAT: the coordinator address we hold a relay reservation at
        self.endpoint = None  # our stream endpoint (see `open_endpoint`), sharing the DHT's daemon
        self._holders: dict[int, list[str]] = {}  # version -> peers the coordinator said hold it

    @property
    def host(self) -> str:
        config = self.session.config
        if config.host is not None:
            return config.host
        return "127.0.0.1" if is_loopback(config.address) else "0.0.0.0"

    @property
    def coordinator(self) -> str:
        return peer_of(self.session.config.address)

    async def join(self) -> bool:
        """Join the DHT; when the coordinator cannot dial us, again as a DHT client that asks the
        coordinator for a relay reservation (`confirm_relay` says once it holds). False if
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
            reply = await endpoint.call_one(self.coordinator, rpc.REACH, ReachRequest(ports[0], relayed),
                                            timeout=CALL_TIMEOUT)
            return reply.reachable
        except (TransportError, ProtocolError, IndexError) as e:
            log.info("reachability check: %s", e)
            return None

    async def confirm_relay(self) -> None:
        """Behind NAT: until the coordinator can dial us through its relay, ask again now and then;
        once it could, it tells peers to reach us through that circuit, so that they can fetch
        from us. libp2p reserves at the coordinator, our one static relay, within seconds;
        meanwhile the node works as usual
        (everything it does, it dials out for). A periodic probe, not a retry: "not yet" is an
        answer, not a failure."""
        started = time.monotonic()
        while not self.session.stopping.is_set():
            if await self._reach(relayed=True):  # from now on the coordinator names us relayed
                console.print(f"reachable through the relay at {self.via_relay} "
                              f"(after {time.monotonic() - started:.0f} s)")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.session.stopping.wait(), RELAY_CHECK)

    async def open_endpoint(self):
        """The endpoint every call and every handler of this node goes through."""
        self.endpoint = await self.dht.endpoint()
        return self.endpoint

    async def peers_holding(self, version: int) -> list[str]:
        """Some peers that hold `version` or later (never us), as the coordinator last named them
        (`echo.holders`): asked once per version, again after `refresh`; [] if it cannot say (the
        fetch then asks the trainer alone). Relayed ones are dialled through its relay."""
        if version in self._holders:
            return self._holders[version]
        try:
            holders = await self.endpoint.call_one(self.coordinator, rpc.HOLDERS, HoldersRequest(version),
                                                   idempotent=True, timeout=CALL_TIMEOUT)
        except (TransportError, ProtocolError) as e:
            log.info("who holds version %d: %s", version, e)
            return []
        if holders.relayed:
            self.endpoint.learn_relays(holders.relayed, self.session.config.address)
        peers = [p for p in holders.peers if p != self.endpoint.peer_id]
        self._holders = {**self._holders, version: peers} if len(self._holders) < MAX_ASKED else {version: peers}
        return peers

    def refresh(self) -> None:
        """Ask again who holds what (the trainer sent its copy on: a peer has it now)."""
        self._holders = {}

    async def holders(self) -> list[str]:
        """Peers holding the base model (every node of the run does, once it works), asked afresh
        at each call: the base download asks once a batch and again at each "busy" of the trainer,
        which has just sent its copy to another node. (Remembered, nodes that all started at once
        and first heard "nobody" fetched from the trainer alone until its patience ran out, 30 s.)"""
        self._holders.pop(0, None)
        return await self.peers_holding(0)

"""Who can be dialled: the reachability check, and relay circuits to peers behind NAT.

A node asks the coordinator (`echo.reach`) whether it can be dialled. The coordinator answers
with a `Prober`: a libp2p host of its own with a fresh identity and no connections, so a dial is
a real test, not an existing connection reused. It dials the asker's port at the IP the asker's
stream came from, never at an address the asker names, so the check cannot be aimed at a third
party; one probe runs at a time, each bounded by PROBE_SECONDS, and past MAX_WAITING queued asks
the asker is told "busy" at once (a relayed probe starts a p2pd daemon: a flood of asks must not
queue honest nodes' checks for minutes). A node that cannot be dialled
joins as a DHT client with the coordinator as its relay (libp2p circuit relay v2: it holds a
reservation there); the coordinator then probes it through its relay (`relayed`) to confirm
the reservation, and from then on names it relayed to nodes asking who holds a version.

`circuit` writes a circuit multiaddr the way p2pd parses it: hivemind's Multiaddr encodes a
/p2p/ part as a CID, which p2pd's connect refuses ("length greater than remaining bytes").
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from protocols.errors import PeerRefused
from protocols.messages import ReachReply, ReachRequest

log = logging.getLogger(__name__)

PROBE_SECONDS = 5.0
MAX_WAITING = 8  # reachability checks queued or running; more are told "busy" at once
_P2P, _P2P_CIRCUIT = 421, 290  # multiaddr protocol codes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def circuit(address: str) -> Multiaddr:
    """`/ip4/A/tcp/P/p2p/RELAY/p2p-circuit` as p2pd's connect accepts it (the relay's peer id as
    a plain multihash). ValueError for anything else."""
    head, sep, tail = address.partition("/p2p/")
    relay, _, rest = tail.partition("/")
    if not sep or rest != "p2p-circuit":
        raise ValueError(f"{address!r} is not a relay circuit address (.../p2p/RELAY/p2p-circuit)")
    relay_id = PeerID.from_base58(relay).to_bytes()
    return Multiaddr(Multiaddr(head).to_bytes() + _varint(_P2P) + _varint(len(relay_id)) + relay_id + _varint(_P2P_CIRCUIT))


def dial_address(observed: str, port: int) -> str | None:
    """Where to dial an asker seen at `observed`: its IP, its listen port. None for a stream that
    came through a relay or over anything but TCP/IP."""
    parts = observed.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
        return None
    return f"/{parts[1]}/{parts[2]}/tcp/{port}"


class Prober:
    """The coordinator's side of `echo.reach`. Direct probes share one host without circuit relay
    (so they cannot succeed through a relay; nodes get a fresh peer id each start, so libp2p's dial
    backoff never answers for a node). A relayed probe gets a host of its own: a node waiting for
    its reservation asks again within seconds, and a shared host would answer "dial backoff"."""

    def __init__(self, host: str, relay_address: str):
        self.host, self.relay_address = host, relay_address  # our own address, for relayed probes
        self.direct: P2P | None = None
        self.lock = asyncio.Lock()
        self.probes = 0
        self.waiting = 0  # checks queued for the lock or running

    async def answer(self, request: ReachRequest, peer: str, observed: str) -> ReachReply:
        if request.relayed:
            target = circuit(self.relay_address + "/p2p-circuit")
        else:
            direct = dial_address(observed, request.port)
            if direct is None:
                return ReachReply(False, observed)
            target = Multiaddr(direct)
        if self.waiting >= MAX_WAITING:
            raise PeerRefused("busy", f"{self.waiting} reachability checks are queued; ask again shortly")
        self.waiting += 1
        try:
            async with self.lock:  # one dial at a time: a flood of asks costs one slow dial each
                self.probes += 1
                if request.relayed:
                    p2p = await self._host(relay=True)
                else:
                    self.direct = self.direct or await self._host(relay=False)
                    p2p = self.direct
                who = PeerID.from_base58(peer)
                try:
                    async with asyncio.timeout(PROBE_SECONDS):
                        await p2p._client.connect(who, [target])
                    reachable = True
                except (P2PDaemonError, TimeoutError) as e:
                    log.info("reach: %s not reachable %s (%s)", peer[-8:], "via our relay" if request.relayed else
                             f"at {target}", e)
                    reachable = False
                finally:
                    if request.relayed:
                        await p2p.shutdown()
                    else:
                        try:
                            await p2p._client.disconnect(who)
                        except P2PDaemonError:
                            pass
        finally:
            self.waiting -= 1
        return ReachReply(reachable, observed)

    async def start(self) -> None:
        """Start the direct host now, so that the first node to join does not wait for it."""
        async with self.lock:
            self.direct = self.direct or await self._host(relay=False)

    async def _host(self, relay: bool) -> P2P:
        return await P2P.create(host_maddrs=[f"/ip4/{self.host}/tcp/0"], use_relay=relay, auto_nat=False,
                                nat_port_map=False, dht_mode="client")

    async def close(self) -> None:
        if self.direct is not None:
            await self.direct.shutdown()

"""Connection reversal (`Endpoint._dial_back`): a caller that reached a node behind NAT through a
relay circuit is dialled back directly (the relayed connection dropped first: libp2p's connect
is a no-op while it stands), once per caller in DIAL_BACK_SECONDS and at most once a second in
all, so that callers with free peer ids cannot make the node dial without end."""

import asyncio

from hivemind.p2p import PeerID

from protocols.transport import streams
from protocols.transport.streams import Endpoint
from tests.unit.protocols.factories import peer_id


class Client:
    def __init__(self):
        self.calls = []

    async def disconnect(self, peer):
        self.calls.append(("disconnect", peer.to_base58()))

    async def connect(self, peer, addrs):
        self.calls.append(("connect", peer.to_base58(), list(addrs)))


class P2P:
    peer_id = PeerID.from_base58(peer_id("Self"))

    def __init__(self):
        self._client = Client()


def test_a_relayed_caller_is_dialled_back_once_and_callers_at_most_once_a_second(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(streams.time, "monotonic", lambda: clock[0])
    endpoint = Endpoint(P2P())
    a, b = PeerID.from_base58(peer_id("A")), PeerID.from_base58(peer_id("B"))

    async def go():
        endpoint._dial_back(a)
        endpoint._dial_back(a)  # the same caller again at once: no second dial
        endpoint._dial_back(b)  # another caller within the second: not now
        clock[0] += 1.5
        endpoint._dial_back(b)
        clock[0] += 1.5
        endpoint._dial_back(a)  # within DIAL_BACK_SECONDS of its last: no
        await asyncio.sleep(0)
        await asyncio.gather(*endpoint._background)

    asyncio.run(go())
    assert endpoint.p2p._client.calls == [("disconnect", peer_id("A")), ("connect", peer_id("A"), []),
                                          ("disconnect", peer_id("B")), ("connect", peer_id("B"), [])]

"""The node's announcement: signed, read back by peers as the version it holds, refreshed at once
when that changes; what peers announced tells the node whom to fetch from."""

import asyncio

from echo_node import presence as presence_module
from echo_node.presence import Presence
from protocols.transport import streams
from tests.unit.echo_node.conftest import ADDRESS
from protocols.messages import verified_announcements
from protocols.signing import fingerprint, generate_key, public_bytes, sign_message
from tests.unit.echo_node.conftest import Backend
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id


class Records:
    """A DHT of subkeyed records, shared by every peer that puts into it."""

    def __init__(self):
        self.records: dict[str, dict[str, bytes]] = {}
        self.puts = 0

    async def put(self, key, value, ttl, subkey=None, timeout=15.0):
        self.puts += 1
        self.records.setdefault(key, {})[subkey] = value
        return True

    async def get(self, key, timeout=15.0):
        return dict(self.records.get(key, {}))


class Endpoint:
    peer_id = peer_id("Self")
    learn_relays = streams.Endpoint.learn_relays  # the real rule, on this stand-in's fields

    def __init__(self):
        self.relays = None


def peer(dht: Records, key: str, **kw):
    """Another peer's signed announcement, put into `dht`."""
    private = generate_key()
    announcement = sign_message(factories.announcement(public_key=public_bytes(private), **kw), private)
    dht.records.setdefault(key, {})[fingerprint(announcement.public_key)] = announcement.to_wire()


def announced(session, endpoint=None) -> tuple[Presence, Records]:
    presence = Presence(session)
    presence.dht, presence.endpoint = Records(), endpoint or Endpoint()
    presence.advertise(Backend(), factories.SHA, "run-1")
    return presence, presence.dht


def test_a_new_version_is_announced_at_once_and_peers_versions_learned(session, monkeypatch):
    monkeypatch.setattr(presence_module, "PEER_REFRESH", 30.0)  # so only a change can explain a re-announce
    presence, dht = announced(session)
    peer(dht, presence.peers_key, peer_id=peer_id("Other"), version=5, relay_addrs=(f"{ADDRESS}/p2p-circuit",))

    async def go():
        announcing = asyncio.create_task(presence.announce())
        await asyncio.sleep(0.1)
        assert dht.puts == 1
        presence.holding(3)
        await asyncio.sleep(0.1)
        announcing.cancel()

    asyncio.run(go())
    assert dht.puts == 2
    ours = dht.records[presence.peers_key][session.fingerprint]  # under our own key's fingerprint
    (mine,) = verified_announcements({session.fingerprint: ours}, "run-1")
    assert (mine.peer_id, mine.version, mine.name, mine.model_sha256, mine.left, mine.run_id) == \
        (peer_id("Self"), 3, session.name, factories.SHA, False, "run-1")
    assert presence.peer_versions == {peer_id("Other"): 5, peer_id("Self"): 3}
    assert presence.endpoint.relays == {peer_id("Other"): (f"{ADDRESS}/p2p-circuit",)}
    assert presence.peers_holding(4) == [peer_id("Other")] and presence.peers_holding(6) == []  # never ourselves


def test_leaving_is_a_signed_withdrawal_readers_skip(session):
    presence, dht = announced(session)
    asyncio.run(presence.withdraw())
    assert verified_announcements(dht.records[presence.peers_key]) == []


def test_base_model_holders_are_every_claim_in_no_claimed_order_and_teach_the_endpoint_every_relay(session):
    """A claimed version puts nobody first: `fetch_chunks` draws from the holders at random."""
    presence, dht = announced(session)
    key = presence.peers_key
    peer(dht, key, peer_id=peer_id("Old"), version=1)
    peer(dht, key, peer_id=peer_id("New"), version=4)
    peer(dht, key, peer_id=peer_id("OtherBase"), version=9, model_sha256="0" * 64, relay_addrs=(f"{ADDRESS}/p2p-circuit",))
    # Issue 36 point 10: a circuit through any relay but the run's (the coordinator) is not
    # learnt: a signed announcement must not make every node dial where it likes.
    peer(dht, key, peer_id=peer_id("Elsewhere"), version=9, model_sha256="0" * 64,
         relay_addrs=(f"/ip4/10.0.0.1/tcp/22/p2p/{peer_id('Coordinator')}/p2p-circuit", "/ip4/1.1.1.1/tcp/1/p2p-circuit"))
    assert sorted(asyncio.run(presence.holders(factories.SHA))) == sorted([peer_id("New"), peer_id("Old")])
    assert set(presence.endpoint.relays) == {peer_id('OtherBase')}


def test_a_reachability_check_that_cannot_say_is_asked_again_then_taken_as_no(session, monkeypatch):
    """Issue 36 point 10: a check that timed out (the coordinator's probes queued behind a flood)
    counted as reachable, so a node behind NAT joined as a DHT server nobody could reach."""
    monkeypatch.setattr(presence_module, "REACH_RETRY", 0.0)
    answers = iter([None, None, True])
    presence = Presence(session)

    async def reach(relayed):
        return next(answers, None)

    monkeypatch.setattr(presence, "_reach", reach)
    assert asyncio.run(presence._reachable()) is True  # the third ask answered
    answers = iter([])
    assert asyncio.run(presence._reachable()) is False

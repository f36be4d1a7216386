"""Whom a node fetches a version from: the coordinator names some holders (`echo.holders`), asked
once per version and again when the trainer says peers have it; what it says is checked, and
only the run's own relay is ever dialled for a relayed peer."""

import asyncio

from echo_node import presence as presence_module
from echo_node.presence import Presence
from protocols import rpc
from protocols.errors import RemoteError, TransportError
from protocols.messages import Holders
from protocols.multiaddr import peer_of
from protocols.transport import streams
from tests.unit.echo_node.conftest import ADDRESS
from tests.unit.protocols.factories import peer_id


class Endpoint:
    """The node's endpoint, answering `echo.holders` from a script of replies."""

    peer_id = peer_id("Self")
    learn_relays = streams.Endpoint.learn_relays  # the real rule, on this stand-in's fields

    def __init__(self, *replies):
        self.replies, self.asked, self.relays = list(replies), [], {}

    async def call_one(self, peer, rpc_, request, idempotent=False, timeout=None):
        assert (peer, rpc_) == (peer_of(ADDRESS), rpc.HOLDERS)
        self.asked.append(request.version)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply if isinstance(reply, Holders) else rpc_.decode_reply(reply)  # as the real endpoint does


def presence_with(session, *replies) -> Presence:
    presence = Presence(session)
    presence.endpoint = Endpoint(*replies)
    return presence


def test_holders_are_asked_once_per_version_and_again_after_a_refresh(session):
    named = Holders((peer_id("Other"), peer_id("Self"), peer_id("Behind")), relayed=(peer_id("Behind"),))
    presence = presence_with(session, named, Holders((peer_id("Other"),)), Holders(()))

    async def go():
        first = await presence.peers_holding(4)
        again = await presence.peers_holding(4)  # remembered: one call per version
        presence.refresh()  # the trainer said "busy": peers have it now
        return first, again, await presence.peers_holding(4), await presence.holders()

    first, again, refreshed, base = asyncio.run(go())
    assert first == again == [peer_id("Other"), peer_id("Behind")]  # never ourselves
    assert refreshed == [peer_id("Other")] and base == []
    assert presence.endpoint.asked == [4, 4, 0]  # the base model: version 0
    # The relayed peer is dialled through the run's one relay, the coordinator.
    assert presence.endpoint.relays == {peer_id("Behind"): (f"{ADDRESS}/p2p-circuit",)}


def test_the_base_models_holders_are_asked_afresh_at_each_try(session):
    """The base download asks at each batch and at each "busy" of the trainer: nodes that start
    together first hear of nobody, and must hear of the first that got it."""
    presence = presence_with(session, Holders(()), Holders((peer_id("First"),)))

    async def go():
        return await presence.holders(), await presence.holders()

    assert asyncio.run(go()) == ([], [peer_id("First")]) and presence.endpoint.asked == [0, 0]


def test_a_coordinator_that_cannot_say_or_says_nonsense_leaves_the_trainer_alone_to_fetch_from(session):
    """No holders is an answer the fetch copes with (it asks the trainer); a failure is not
    remembered, so the next fetch asks again."""
    junk = Holders((peer_id("Other"),)).to_dict() | {"peers": ["Qm-not-base58"]}
    from protocols import wire

    presence = presence_with(session, TransportError("no reply"), RemoteError("busy", "later", "x", "echo.holders"),
                             wire.pack(Holders.KIND, junk), Holders((peer_id("Other"),)))

    async def go():
        return [await presence.peers_holding(2) for _ in range(4)]

    assert asyncio.run(go()) == [[], [], [], [peer_id("Other")]]
    assert presence.endpoint.relays == {}


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

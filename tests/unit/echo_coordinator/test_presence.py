"""Whom the coordinator names when a node asks who holds a version (`echo.holders`): holders of
that version or a later one, never the asker, proven keys' peers before mere claims, at most
MAX_HOLDERS, spread at random; relayed ones marked, from our own relayed probes only."""

import random

from echo_coordinator.presence import MAX_RELAYED, Presence, pick_holders
from echo_coordinator.service.registry import Registry
from protocols.messages import MAX_HOLDERS, HoldersRequest
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id


def test_holders_of_the_version_or_later_never_the_asker():
    versions = {peer_id("Old"): 1, peer_id("New"): 4, peer_id("Newer"): 5, peer_id("Asker"): 9}
    named = pick_holders(versions, frozenset(), {peer_id("Newer"): None}, 4, peer_id("Asker"))
    assert sorted(named.peers) == sorted([peer_id("New"), peer_id("Newer")])
    assert named.relayed == (peer_id("Newer"),)
    assert pick_holders(versions, frozenset(), {}, 10, peer_id("Old")).peers == ()


def test_a_flood_of_claims_never_hides_a_proven_holder_and_askers_are_spread():
    """A thousand fresh keys claim the version; the three peers whose keys had work accepted are
    named first in every answer, and the rest of each answer is drawn at random."""
    proven = frozenset(peer_id(f"Proven{i}") for i in range(3))
    versions = {**{peer_id(f"Claim{i}"): 7 for i in range(1000)}, **{p: 7 for p in proven}}
    rng = random.Random(0)
    answers = [pick_holders(versions, proven, {}, 7, peer_id("Asker"), rng).peers for _ in range(20)]
    assert all(len(a) == MAX_HOLDERS and set(a[:3]) == proven for a in answers)
    assert len({p for a in answers for p in a[3:]}) > 10 * MAX_HOLDERS  # not the same few claimants each time


def test_proven_peers_are_those_of_keys_with_work_accepted_lately():
    registry, now = Registry(), 100.0
    worker, claimant = bytes([1]) * 32, bytes([2]) * 32
    for key, name in ((worker, "Worker"), (claimant, "Claimant")):
        registry.heard(factories.lease_request(node_key=key, version=2, time=now), peer_id(name), now)
    registry.throughput.pushed(factories.lease_request(node_key=worker).node_id, 8, now - 5, now)
    versions, proven = registry.relay_holders(now, latest=2)
    assert versions == {peer_id("Worker"): 2, peer_id("Claimant"): 2} and proven == {peer_id("Worker")}


def test_relayed_peers_are_those_our_relayed_probe_reached_and_are_bounded(monkeypatch):
    presence = Presence(dht=None, run_fingerprint="fp")
    presence.peer_versions = {peer_id("Behind"): 1, peer_id("Direct"): 1}
    presence.reached(peer_id("Behind"), relayed=True)
    presence.reached(peer_id("Direct"), relayed=False)
    assert presence.holders(HoldersRequest(1), peer_id("Asker")).relayed == (peer_id("Behind"),)
    presence.reached(peer_id("Behind"), relayed=False)  # reached directly since: no longer relayed
    assert presence.holders(HoldersRequest(1), peer_id("Asker")).relayed == ()
    for i in range(MAX_RELAYED + 5):
        presence.reached(f"peer-{i}", relayed=True)
    assert len(presence.relayed) == MAX_RELAYED and "peer-0" not in presence.relayed

"""Peer accounting rules: rate limit, the allow-list, relay holders (the trust rule: test_trust)."""

import pytest

from echo_coordinator.service.policing import RateLimit, read_allow_list, relay_holders
from echo_coordinator.service.registry import LIVE_SECONDS, Registry
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id


def test_rate_limit_allows_bursts_then_the_rate():
    limit = RateLimit(rate=2.0, burst=4.0)
    assert [limit.allow("a", 0.0) for _ in range(5)] == [True] * 4 + [False]
    assert limit.allow("b", 0.0)  # per peer
    assert limit.allow("a", 0.5) and not limit.allow("a", 0.5)  # 2 a second refill one token in 0.5 s
    limit.forget_idle(100.0)
    assert limit._buckets == {}


def test_allow_list(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# volunteers we know\n" + "a" * 26 + "  # alice\n\n" + "B2" * 13 + "\n")
    assert read_allow_list(path) == {"a" * 26, "b2" * 13}
    path.write_text("not-a-key\n")
    with pytest.raises(ValueError, match="keys.txt:1"):
        read_allow_list(path)


def test_relays_are_the_peers_that_keys_asked_from_lately_at_versions_published():
    """The relay's holders come from lease requests (their peer is the transport's) of keys that
    asked lately: a version not yet published, or a key gone quiet, counts for nothing."""
    registry, now = Registry(), 100.0
    keys = {name: bytes([i]) * 32 for i, name in enumerate(("live", "quiet", "future"), 1)}
    for name, version, at in (("live", 3, now), ("quiet", 2, now - LIVE_SECONDS - 1), ("future", 10**9, now)):
        request = factories.lease_request(node_key=keys[name], version=version, peer_id=peer_id(name.title()),
                                          hardware="x86_64, 2 cores", time=at)
        registry.heard(request, peer_id(name.title()), at)
    assert registry.relay_holders(now, latest=3) == ({peer_id("Live"): 3}, frozenset())  # none proven yet
    assert registry.nodes(now, {})[factories.lease_request(node_key=keys["live"]).node_id]["hardware"] == "x86_64, 2 cores"
    assert relay_holders({"a": "PeerA", "b": "PeerB"}, {"a": 2, "c": 1}, latest=2) == {"PeerA": 2}  # b said no version

"""Peer accounting rules: rate limit, the allow-list, relay holders (the trust rule: test_trust)."""

import pytest

from echo_coordinator.service.policing import RateLimit, read_allow_list, relay_holders
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


def test_only_announcements_of_nodes_that_talked_count_as_relays():
    live = factories.announcement(peer_id=peer_id("Live"), version=3, public_key=bytes(range(32)))
    claim = factories.announcement(peer_id=peer_id("Fake"), version=99, throughput=1e9, public_key=bytes(range(1, 33)))
    moved = factories.announcement(peer_id=peer_id("Elsewhere"), version=5, public_key=bytes(range(2, 34)))
    future = factories.announcement(peer_id=peer_id("Future"), version=10**9, public_key=bytes(range(3, 35)))
    talked = {live.node_id: peer_id("Live"), moved.node_id: peer_id("Other"), future.node_id: peer_id("Future")}  # moved: another peer spoke
    assert relay_holders([live, claim, moved, future], talked, latest=3) == {peer_id("Live"): 3}  # a version not yet published

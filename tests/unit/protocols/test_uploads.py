import pytest

from protocols.uploads import ByteQuota, UploadBudget
from tests.unit.protocols.factories import peer_id


def test_first_nodes_get_whole_copies_the_rest_fetch_from_peers():
    budget = UploadBudget(copies=1, grace=3.0)
    budget.register("u")
    assert budget.allow("u", "a", now=0, peers_holding=0)
    assert budget.allow("u", "a", now=1, peers_holding=0)  # a keeps fetching its whole copy
    assert not budget.allow("u", "b", now=1, peers_holding=0)  # a is still at it: b waits
    assert not budget.allow("u", "b", now=30, peers_holding=1)  # a holds it now: b fetches from a
    assert budget.allow("u", "c", now=30, peers_holding=0)  # nobody holds it (a left): let one more in
    assert not budget.allow("u", "d", now=31, peers_holding=0)
    assert budget.allow("u", "d", now=33, peers_holding=0)


def test_accounts_are_per_update_and_unknown_updates_are_not_limited():
    budget = UploadBudget(copies=2)
    budget.register("x")
    budget.register("y")
    assert budget.allow("x", "a", 0, 1) and budget.allow("x", "b", 0, 1) and not budget.allow("x", "c", 0, 1)
    assert budget.allow("y", "c", 0, 1)
    budget.forget("x")
    assert budget.allow("x", "z", 0, 5)


def test_peers_that_claim_an_update_and_never_serve_it_delay_an_asker_only_so_long():
    """Fresh keys fetch first and claim holding every version (or 10**9): while they do, the
    trainer turns askers away to fetch from them; after `patience` an asker is let in anyway."""
    budget = UploadBudget(copies=2, grace=3.0, patience=30.0)
    budget.register("u")
    assert budget.allow("u", "sybil1", 0, 0) and budget.allow("u", "sybil2", 0, 0)
    assert not budget.allow("u", "honest", 1, peers_holding=2)
    assert not budget.allow("u", "honest", 30, peers_holding=2)
    assert budget.allow("u", "honest", 31, peers_holding=2)  # turned away since 1: 30 s
    assert not budget.allow("u", "other", 31, peers_holding=2)  # each asker waits its own time


def test_a_volunteers_upload_quota_holds_whoever_asks():
    quota = ByteQuota(rate=100.0, burst=300.0, per_hour=1000.0)
    assert quota.take(300, now=0.0) and not quota.take(1, now=0.0)  # the burst is spent
    assert not quota.take(200, now=1.0) and quota.take(200, now=2.0)  # 100 bytes a second
    for t in range(3, 8):
        quota.take(100, now=float(t))
    assert not quota.take(100, now=100.0)  # 1000 bytes this hour already
    assert quota.take(100, now=3601.0)  # the first sends left the hour's window


def test_a_relay_past_its_quota_answers_busy(tmp_path):
    from protocols.messages import ModelFile
    from protocols.signing import sha256_hex
    from protocols.transport.relay import Busy, Relay

    data = bytes(range(256)) * 16
    path = tmp_path / "base.gguf"
    path.write_bytes(data)
    listed = ModelFile(run_id="r", name="base.gguf", sha256=sha256_hex(data), size=len(data), chunk_size=len(data),
                       chunks=(sha256_hex(data),))
    relay = Relay(quota=ByteQuota(rate=1.0, burst=len(data), per_hour=10 * len(data)))
    relay.serve_file(listed, path)
    assert relay.chunk(listed.chunks[0], peer_id("A"), now=0.0) == data
    path.unlink()  # past the budget the file is not even read
    with pytest.raises(Busy, match="upload budget"):
        relay.chunk(listed.chunks[0], peer_id("Fresh"), now=1.0)  # another peer id changes nothing
    assert relay.bytes_served == len(data)


def test_a_late_joiners_snapshot_is_not_left_to_peers_that_hold_only_deltas():
    """Peers announcing the latest version got there step by step: the trainer sends a step's later
    askers to them, but a snapshot's from further back, one more every `grace` seconds, itself."""
    from protocols.transport.relay import Busy, Relay
    from tests.unit.protocols import factories

    budget = UploadBudget(copies=1, grace=3.0, patience=30.0)
    relay = Relay(keep_versions=2, budget=budget, peers_holding=lambda version: 5)
    relay.remember(factories.update(from_version=1, to_version=2, replaces=False), {"delta": b"d"})
    relay.remember(factories.update(from_version=0, to_version=2, replaces=True), {"snapshot": b"s"})
    assert relay.chunk("delta", peer_id("First"), now=0.0) == b"d" and relay.chunk("snapshot", peer_id("First"), now=0.0) == b"s"
    with pytest.raises(Busy):
        relay.chunk("delta", peer_id("Late"), now=3.0)  # five peers hold version 2: fetch the delta from them
    assert relay.chunk("snapshot", peer_id("Late"), now=3.0) == b"s"
    with pytest.raises(Busy):
        relay.chunk("snapshot", peer_id("Later"), now=4.0)  # a burst of late joiners: one every 3 s
    assert relay.chunk("snapshot", peer_id("Later"), now=6.0) == b"s"
    # A first snapshot (0 -> 1) is every follower's step: later askers fetch it from them.
    relay.remember(factories.update(from_version=0, to_version=1, replaces=True), {"first": b"f"})
    assert relay.chunk("first", peer_id("First"), now=7.0) == b"f"
    with pytest.raises(Busy):
        relay.chunk("first", peer_id("Late"), now=10.0)

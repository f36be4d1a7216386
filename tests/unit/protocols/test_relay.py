"""What a relay keeps serving: a late joiner at any version can still reach the latest."""

from hypothesis import given
from hypothesis import strategies as st

from protocols.catchup import Step, plan
from protocols.transport.relay import Relay
from tests.unit.protocols import factories


def publish(relay: Relay, version: int, snapshot_every: int) -> None:
    relay.remember(factories.update(from_version=version - 1, to_version=version, replaces=False), {})
    if version % snapshot_every == 0:
        relay.remember(factories.update(from_version=0, to_version=version, replaces=True), {})


@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 5))
def test_every_version_reaches_the_latest(latest, snapshot_every, keep):
    relay = Relay(keep_versions=keep)
    for version in range(1, latest + 1):
        publish(relay, version, snapshot_every)
    offered = [Step(u.from_version, u.to_version, u.nbytes, u.replaces) for u in relay.index().updates]
    for held in range(latest):
        assert plan(held, latest, offered)[-1].to_version == latest  # raises if there is a gap
    # Bounded: the newest snapshot and the deltas since it, or the last `keep` versions' updates.
    assert len(relay.updates) <= 2 * max(keep, snapshot_every) + 1


def test_old_deltas_before_the_newest_snapshot_are_forgotten():
    relay = Relay(keep_versions=2)
    for version in range(1, 16):
        publish(relay, version, 10)
    assert sorted(relay.updates) == [(0, 10), *((v - 1, v) for v in range(11, 16))]

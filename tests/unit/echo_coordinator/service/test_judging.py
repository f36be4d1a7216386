"""The pure decisions of a push, without a service: sample shapes, the versions a lease admits,
and a judged batch as GRPO groups."""

import pytest

from echo_coordinator.service.judging import Refused, check_claimed_version, check_samples, groups
from protocols.errors import InvalidValue
from protocols.messages import RolloutBatch, RolloutSample, Segment
from protocols.signing import fingerprint
from tests.unit.protocols.factories import peer_id

KEY = bytes(range(32))
PROMPTS = {7: (1, 2, 3), 8: (1, 2, 4)}  # the leased seeds and their prompts


def batch(*samples: RolloutSample, version: int = 0) -> RolloutBatch:
    return RolloutBatch("run-1", "L0", version, KEY, tuple(samples))


def sample(seed: int, prompt: tuple[int, ...] | None = None, completion=(5, 6), segments=()) -> RolloutSample:
    return RolloutSample(seed, PROMPTS[seed] if prompt is None else prompt, completion, (-0.5,) * len(completion), segments)


def test_a_batch_that_answers_its_lease_exactly_passes():
    check_samples(batch(sample(7), sample(8), sample(8), sample(7)), PROMPTS, group=2, vocab_size=10)


@pytest.mark.parametrize("samples, match", [
    ((sample(7), sample(7), sample(8)), "2 samples for each leased seed"),  # one seed short of its group
    ((sample(7), sample(7), sample(7), sample(8), sample(8)), "2 samples for each leased seed"),  # one too many
    ((sample(7), sample(7)), "2 samples for each leased seed"),  # a leased seed unanswered
    ((sample(7), sample(7), sample(8), sample(8), RolloutSample(9, (1,), (5,), (-0.5,)),
      RolloutSample(9, (1,), (5,), (-0.5,))), "2 samples for each leased seed"),  # a seed it was not leased
    ((sample(7), sample(7), sample(8), sample(8, prompt=(1, 2, 3))), "leased prompt"),  # another seed's prompt
    ((sample(7), sample(7), sample(8), sample(8, completion=(5, 10))), "outside vocab"),
])
def test_a_batch_that_does_not_answer_its_lease_is_refused(samples, match):
    with pytest.raises(InvalidValue, match=match):
        check_samples(batch(*samples), PROMPTS, group=2, vocab_size=10)


def refusal(lease: int, claimed: int) -> str | None:
    try:
        check_claimed_version(lease, claimed)
    except Refused as e:
        return e.code
    return None


def test_a_lease_admits_exactly_its_own_version():
    # The lease fixed it (`protocols.sync.lease_version`): an async node whose update failed has a
    # lease of its own older version, not a choice between that one and the newest.
    assert [refusal(3, v) for v in (2, 3, 4)] == ["wrong_version", None, "future"]


def test_groups_are_per_seed_with_our_rewards_and_the_nodes_tokens():
    env_turn = (Segment("model", 1), Segment("env", 2), Segment("model", 1))
    judged = batch(sample(7), sample(8, completion=(5, 6, 6, 5), segments=env_turn), sample(7, completion=(6,)),
                   sample(8), version=3)
    made = groups(judged, [1.0, 0.0, 0.5, 0.25], peer_id("Peer"), "alice")
    assert [g.seed for g in made] == [7, 8]  # in the order seeds first appear
    seven, eight = made
    assert [s.reward for s in seven.samples] == [1.0, 0.5] and [s.reward for s in eight.samples] == [0.0, 0.25]
    assert [s.completion_ids for s in seven.samples] == [(5, 6), (6,)]
    assert all(s.group == g.seed for g in made for s in g.samples)
    assert (seven.tokens, eight.tokens) == (3, 4)  # env-written tokens are not the node's work
    assert eight.samples[0].loss_mask == (1, 0, 0, 1)
    assert {(g.lease_id, g.version, g.node_id, g.peer_id, g.name) for g in made} == {
        ("L0", 3, fingerprint(KEY), peer_id("Peer"), "alice")}

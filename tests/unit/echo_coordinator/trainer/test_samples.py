"""TrainSample's one codec (journal rows and rank-0-to-worker batches): a round trip keeps every
field, staleness included; rows written before staleness was encoded still decode."""

from __future__ import annotations

import msgpack

from echo_coordinator.trainer import samples as codec
from echo_coordinator.trainer.samples import TrainSample
from protocols.messages import RolloutSample, Segment


def test_a_round_trip_keeps_every_field():
    made = [TrainSample((1, 2), (3, 4), (-0.5, -1.5), (1, 0), 0.75, 7, staleness=2),
            TrainSample((5,), (6,), (-0.1,), (1,), 0.0, 8)]
    assert codec.decode(codec.encode(made)) == made


def test_journal_rows_without_staleness_decode_at_staleness_zero():
    legacy = msgpack.packb([[[1, 2], [3], [-0.5], [1], 1.0, 4]])
    assert codec.decode(legacy) == [TrainSample((1, 2), (3,), (-0.5,), (1,), 1.0, 4, staleness=0)]


def test_a_rollout_sample_becomes_a_train_sample_with_the_trainer_s_reward():
    sample = RolloutSample(9, (1, 2), (3, 4, 5), (-0.1, 0.0, -0.2), segments=(Segment("model", 1), Segment("env", 1),
                                                                              Segment("model", 1)))
    made = TrainSample.of(sample, reward=0.5)
    assert (made.prompt_ids, made.completion_ids, made.behaviour) == ((1, 2), (3, 4, 5), (-0.1, 0.0, -0.2))
    assert made.loss_mask == (1, 0, 1) and made.reward == 0.5 and made.group == 9 and made.staleness == 0

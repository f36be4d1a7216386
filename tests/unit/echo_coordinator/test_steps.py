"""The step loop's verification of unchecked batches it cannot verify from its own forward: an
async batch that waited for its step and was sampled with an older version is verified apart,
before the step, as its push would have been; a refused one leaves the batch and is struck."""

import asyncio

from echo_coordinator.ledger import Ledger
from echo_coordinator.service import LeaseSettings, Policing
from echo_coordinator.trust import BanRule
from echo_coordinator.steps import StepLoop
from echo_coordinator.verify import Verifier
from protocols.sampling import SamplingRule
from protocols.signing import fingerprint, generate_key, public_bytes
from tests.unit.echo_coordinator.service.test_run_service import (NOW, GROUP, advance, answer_batch, lease_request,
                                                                  make_service, made, push, sampled_batch,  # noqa: F401
                                                                  toy_evidence)
from tests.unit.protocols.factories import peer_id


def test_a_batch_that_waited_past_its_version_is_verified_apart_before_the_step(tmp_path, made):  # noqa: F811
    verifier = Verifier(toy_evidence, SamplingRule(), keep_versions=2)
    verifier.remember(0, {})
    policing = Policing(verifier, bans=BanRule(first=60), in_step=True)
    svc = make_service(Ledger(tmp_path / "ledger.sqlite"), LeaseSettings(lease_seconds=600, seeds_per_lease=1, first_seed=100),
                       policing, mode="async", staleness=1)
    made.append(svc)
    node = generate_key()
    push(svc, sampled_batch(node, svc.handle_lease(lease_request(node), now=NOW)), peer_id("Node"))  # checked at its push
    push(svc, sampled_batch(node, svc.handle_lease(lease_request(node), now=NOW)), peer_id("Node"))  # waits for its step
    push(svc, answer_batch(svc, node, svc.handle_lease(lease_request(node), now=NOW)), peer_id("Node"))  # written; waits
    verifier.remember(1, {})
    advance(svc, 1)  # no step trained them at version 0
    batch = svc.take_batch()
    assert len(batch.unchecked) == 2 and len(batch.samples) == 3 * GROUP
    loop = StepLoop(None, None, svc.manifest, svc, None, None, None, verifier, svc.ledger, None)
    checked = verifier.checked_samples
    kept = asyncio.run(loop._verify_late(batch, 1))
    assert verifier.checked_samples == checked + 2 * GROUP and verifier.free_samples == 0
    assert len(kept.samples) == 2 * GROUP and kept.unchecked == []  # the written batch is out, nothing waits
    assert kept.samples == batch.samples[:2 * GROUP] and kept.staleness == [1] * 2 * GROUP
    trust = svc.ledger.trust(fingerprint(public_bytes(node)))
    assert trust.failed == 1 and trust.verified == 2
    assert svc.rejection_counts()["bad_sampling"] == GROUP


def test_a_step_that_trained_on_samples_older_than_was_shown_stable_is_flagged():
    from collections import Counter

    from echo_coordinator.config import SHOWN_STABLE_STALENESS, staleness_caution
    from echo_coordinator.service.buffer import StepBatch
    from echo_coordinator.steps import Tally, step_record
    from echo_coordinator.trainer.learner import StepStats

    stats = StepStats(samples=2, trained_samples=2, tokens=8, loss=0.0, tis_clipped_fraction=0.0,
                      ratio_clipped_fraction=0.0, mismatch_kl=0.0, mean_log_ratio=0.0, log_ratio_m2=0.0,
                      log_ratio_by_staleness={}, busy_seconds=1.0)
    tally = Tally(Counter(), 0, 0.0, 0, 0)

    def record(ages: list[int]) -> dict:
        batch = StepBatch(samples=[], rewards=[0.0, 1.0], staleness=ages, dropped=0)
        return step_record("async", 9, batch, stats, tally, tally, 0.0, 0.0, 1.0)

    assert record([0, SHOWN_STABLE_STALENESS])["staleness_beyond_shown"] is False
    assert record([0, SHOWN_STABLE_STALENESS + 1])["staleness_beyond_shown"] is True
    # and a run that allows such samples is told at its start; sequential runs have none
    assert staleness_caution("async", SHOWN_STABLE_STALENESS) is None
    assert staleness_caution("sequential", 100) is None
    assert f"older than the {SHOWN_STABLE_STALENESS} versions" in staleness_caution("async", SHOWN_STABLE_STALENESS + 1)

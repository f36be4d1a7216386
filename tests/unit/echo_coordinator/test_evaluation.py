"""Held-out evaluation rounds in the coordinator's service: who gets evaluation leases, how answers
are judged and credited, and that nothing evaluated is ever trained on."""

import dataclasses

import numpy as np
import pytest

from echo_coordinator.evaluation import EvalSet, due
from echo_coordinator.ledger import Ledger
from echo_coordinator.service import LeaseSettings, Policing, Refused, RunService, Work
from echo_coordinator.trust import SpotCheck
from echo_coordinator.verify import Verifier
from protocols.errors import InvalidValue, LeaseError, PeerRefused, VerificationError
from protocols.messages import NoWork, RolloutBatch, RolloutSample, TaskLease
from protocols.sampling import SamplingRule, choose, gumbel, log_softmax, sample_seed
from protocols.signing import fingerprint, generate_key, public_bytes, sign_message
from tasks import make_task
from tests.unit.echo_coordinator.service.test_run_service import (
    EOS, GROUP, LOGITS, NOW, TRANSCRIPTS, lease_request, push, toy_evidence,
)
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id

EVAL_SEEDS = (10**12, 10**12 + 1, 10**12 + 2, 10**12 + 3)


def make_service(tmp_path, mode="sequential", sampling="greedy", verify=False) -> RunService:
    run_key = generate_key()
    manifest = factories.manifest(run_key=public_bytes(run_key), group_size=GROUP, max_new_tokens=8, vocab_size=1000,
                                  mode=mode)
    task = make_task("arithmetic")
    evaluation = EvalSet.of(EVAL_SEEDS, lambda seed: (4, 5, seed % 50), sampling, samples=3)
    verifier = None
    if verify:
        verifier = Verifier(toy_evidence, SamplingRule(), keep_versions=0)
        verifier.remember(0, {})
    work = Work(task, render_prompt=lambda seed: (1, 2, 3 + seed % 50), transcripts=TRANSCRIPTS, evaluation=evaluation)
    svc = RunService(manifest, run_key, Ledger(tmp_path / "ledger.sqlite"), work,
                     LeaseSettings(lease_seconds=60, seeds_per_lease=1),
                     # Spot checks that never draw a training batch: evaluation batches are checked anyway.
                     Policing(verifier, SpotCheck(fraction=1e-9, trust_after=0)))
    svc.begin()
    return svc


def answers(svc, key, lease: TaskLease, right=True, per_prompt=None, version=None) -> RolloutBatch:
    samples = []
    for seed, prompt in zip(lease.seeds, lease.prompts):
        answer = int(svc.work.task_of(evaluation=True).generate(seed).answer) + (0 if right else 1)
        samples += [RolloutSample(seed, prompt, (answer, EOS), (-0.5, -0.1))] * (per_prompt or lease.samples)
    batch = RolloutBatch("run-1", lease.lease_id, lease.version if version is None else version, public_bytes(key),
                         tuple(samples))
    return sign_message(batch, key)


def test_due_versions():
    assert [v for v in range(8) if due(v, 3, last=7)] == [0, 3, 6, 7]
    assert not any(due(v, 0, last=7) for v in range(8))  # 0: no evaluation


def test_sequential_evaluates_when_idle_and_never_trains_on_it(tmp_path):
    svc, node = make_service(tmp_path), generate_key()
    svc.open_step([1])
    svc.open_eval(0, None, now=NOW)
    first = svc.handle_lease(lease_request(node), now=NOW)
    assert not first.evaluation  # training work first: sequential nodes evaluate while the trainer steps
    push(svc, sign_message(RolloutBatch("run-1", first.lease_id, 0, public_bytes(node), tuple(
        RolloutSample(1, first.prompts[0], (7, EOS), (-0.5, -0.1)) for _ in range(GROUP))), node), peer_id("Node"), now=NOW)
    lease = svc.handle_lease(lease_request(node), now=NOW)
    # Greedy: one completion per prompt, so about a training lease's worth of prompts (1 seed x G).
    assert lease.evaluation and lease.greedy and lease.samples == 1 and lease.version == 0
    assert lease.seeds == EVAL_SEEDS[:GROUP] and lease.prompts == tuple((4, 5, s % 50) for s in EVAL_SEEDS[:GROUP])
    assert push(svc, answers(svc, node, lease), peer_id("Node"), now=NOW).accepted == GROUP
    assert svc.take_eval_records() == []  # half the seeds answered: not finished
    second = svc.handle_lease(lease_request(node), now=NOW)
    push(svc, answers(svc, node, second, right=False), peer_id("Node"), now=NOW)
    (record,) = svc.take_eval_records(now=NOW + 5)  # timed when it finished, not when logged
    assert record["eval_version"] == 0 and record["eval_accuracy"] == 0.5 and record["eval_samples"] == 4
    assert record["eval_complete"] and record["eval_sampling"] == "greedy" and record["eval_seconds"] < 1  # when done
    assert isinstance(svc.handle_lease(lease_request(node), now=NOW), NoWork) and not svc.evaluating()
    # Never trained on: only the one training group is in the buffer; credited apart.
    batch = svc.take_batch()
    svc.commit_step(0)
    assert [s.group for s in batch.samples] == [1] * GROUP
    (peer,) = svc.ledger.peers()
    assert peer["accepted"] == GROUP and peer["eval_samples"] == 4


def test_a_node_answers_the_round_of_its_version_before_moving_on(tmp_path):
    """Sequential: round 0 still has seeds when step 1's work appears; a node holding version 0 takes
    them first, or nobody could (nodes never move back)."""
    svc = make_service(tmp_path)
    svc.open_eval(0, None, now=NOW)
    svc.gate.advance(1)
    svc.open_step([1])
    at_zero = svc.handle_lease(lease_request(generate_key(), version=0), now=NOW)
    assert at_zero.evaluation and at_zero.version == 0
    at_one = svc.handle_lease(lease_request(generate_key(), version=1), now=NOW)
    assert not at_one.evaluation and at_one.version == 1


def test_async_evaluates_first_and_only_nodes_not_past_the_version(tmp_path):
    svc = make_service(tmp_path, mode="async", sampling="sampled")
    svc.open_eval(0, None, now=NOW)
    lease = svc.handle_lease(lease_request(generate_key()), now=NOW)
    assert lease.evaluation and not lease.greedy and lease.samples == 3 and len(lease.seeds) == 1  # 3 x 1 ~ G = 2
    ahead = svc.handle_lease(lease_request(generate_key(), version=1), now=NOW)
    assert not ahead.evaluation  # it holds version 1: it cannot answer for version 0


@pytest.mark.parametrize("tamper, error, reason", [
    (lambda svc, node, other, lease: answers(svc, node, lease, version=1), Refused, "future"),  # exactly its version
    (lambda svc, node, other, lease: answers(svc, node, lease, per_prompt=2), InvalidValue, "invalid_value"),  # greedy: 1
    (lambda svc, node, other, lease: answers(svc, other, lease), LeaseError, "bad_lease"),  # somebody else's lease
])
def test_bad_evaluation_answers_are_refused_counted_and_reissued(tmp_path, tamper, error, reason):
    svc, node, other = make_service(tmp_path), generate_key(), generate_key()
    svc.open_eval(0, None, now=NOW)
    lease = svc.handle_lease(lease_request(node), now=NOW)
    bad = tamper(svc, node, other, lease)
    with pytest.raises(error):
        push(svc, bad, peer_id("Node"), now=NOW)
    (peer,) = [p for p in svc.ledger.peers() if p["node_id"] == bad.node_id]
    assert peer["rejected_by_reason"] == {reason: len(bad.samples)} and peer["eval_samples"] == 0
    if error is not LeaseError:  # the holder's failed attempt gives its seeds back at once
        assert svc.handle_lease(lease_request(other), now=NOW).seeds == lease.seeds
    assert push(svc, answers(svc, node, svc.handle_lease(lease_request(node, time=NOW + 1), now=NOW + 1)), peer_id("Node"),
                now=NOW + 1).accepted > 0
    assert svc.take_eval_records() == []


def test_giving_up_logs_an_incomplete_round_and_old_rounds_make_way(tmp_path):
    svc = make_service(tmp_path, sampling="both")
    for version in range(3):
        svc.open_eval(version, None, now=NOW)  # 2 rounds a version; 4 may be open
    records = svc.take_eval_records(now=NOW)
    assert [(r["eval_version"], r["eval_sampling"], r["eval_complete"]) for r in records] == [
        (0, "greedy", False), (0, "sampled", False)]
    assert len(svc.take_eval_records(give_up=True, now=NOW)) == 4 and not svc.evaluating()


def greedy_batch(key, lease: TaskLease, tokens=8, noise=False) -> RolloutBatch:
    """The toy model answering an evaluation lease: argmax, or (a cheat) sampling with noise."""
    samples = []
    for seed, prompt in zip(lease.seeds, lease.prompts):
        g = gumbel(sample_seed(lease.lease_id, seed, 0), np.arange(tokens), len(LOGITS)) if noise else np.zeros((tokens, 1))
        ids = tuple(choose(LOGITS, row) for row in g)
        samples.append(RolloutSample(seed, prompt, ids, tuple(float(log_softmax(LOGITS)[i]) for i in ids)))
    return sign_message(RolloutBatch("run-1", lease.lease_id, lease.version, public_bytes(key), tuple(samples)), key)


def test_greedy_answers_are_verified_against_the_rounds_weights(tmp_path):
    svc, honest, cheat = make_service(tmp_path, verify=True), generate_key(), generate_key()
    svc.open_eval(0, {}, now=NOW)
    lease = svc.handle_lease(lease_request(honest), now=NOW)
    assert push(svc, greedy_batch(honest, lease), peer_id("Honest"), now=NOW).accepted == len(lease.seeds)
    lease = svc.handle_lease(lease_request(cheat, name="mallory"), now=NOW)
    with pytest.raises(VerificationError):
        push(svc, greedy_batch(cheat, lease, noise=True), peer_id("Cheat"), now=NOW)  # sampled where greedy was asked
    assert svc.ledger.trust(fingerprint(public_bytes(cheat))).failed == 1
    assert svc.ledger.trust(fingerprint(public_bytes(honest))).verified == 1
    # The round's weights are what it verifies against, whatever the verifier holds for training.
    svc.policing.verifier.held.clear()
    lease = svc.handle_lease(lease_request(honest), now=NOW)
    assert push(svc, greedy_batch(honest, lease), peer_id("Honest"), now=NOW).accepted == len(lease.seeds)


def sampled_answers(key, lease: TaskLease, noise_id: str) -> RolloutBatch:
    """The toy model sampling an evaluation lease with the noise of `noise_id`."""
    samples = []
    for seed, prompt in zip(lease.seeds, lease.prompts):
        for j in range(lease.samples):
            ids = tuple(choose(LOGITS, row) for row in gumbel(sample_seed(noise_id, seed, j), np.arange(8), len(LOGITS)))
            samples.append(RolloutSample(seed, prompt, ids, tuple(float(log_softmax(LOGITS)[i]) for i in ids)))
    return sign_message(RolloutBatch("run-1", lease.lease_id, lease.version, public_bytes(key), tuple(samples)), key)


def test_a_sampled_rounds_noise_is_the_rounds_so_an_abandoned_seed_is_not_re_rolled(tmp_path):
    """Issue 36 point 4: a node that lets the leases whose answers scored badly lapse used to have
    those seeds sampled again, with another lease's noise, by whoever took them next. The noise
    is the round's: the next node samples the same answers, and one sampling with its lease id's
    noise is refused."""
    svc, quitter, taker, cheat = make_service(tmp_path, sampling="sampled", verify=True), *(generate_key() for _ in range(3))
    svc.open_eval(0, {}, now=NOW)
    first = svc.handle_lease(lease_request(quitter), now=NOW)
    assert first.noise and first.noise_id != first.lease_id
    later = NOW + 61  # the quitter's lease lapsed, unanswered
    again = svc.handle_lease(lease_request(taker, time=later), now=later)
    assert again.seeds == first.seeds and again.lease_id != first.lease_id and again.noise_id == first.noise_id
    with pytest.raises(PeerRefused) as e:  # an evaluation lease's lapse counts as a training one's (point 2)
        svc.handle_lease(lease_request(quitter, time=later), now=later)
    assert e.value.code == "lapsed"
    batch = sampled_answers(taker, again, again.noise_id)
    assert [s.completion_ids for s in batch.samples] == \
        [s.completion_ids for s in sampled_answers(quitter, first, first.noise_id).samples]
    assert push(svc, batch, peer_id("Taker"), now=later).accepted == len(batch.samples)
    lease = svc.handle_lease(lease_request(cheat, time=later), now=later)
    with pytest.raises(VerificationError):
        push(svc, sampled_answers(cheat, lease, lease.lease_id), peer_id("Cheat"), now=later)


def test_lease_wire_round_trip():
    base = TaskLease("L1", "run-1", "n", (1, 2), ((3,), (4,)), 2, 9.0)
    for lease in (base, dataclasses.replace(base, evaluation=True, samples=4, greedy=True),
                  dataclasses.replace(base, evaluation=True, samples=4, noise="ab12-e3s-")):
        assert TaskLease.from_wire(lease.to_wire()) == lease
    assert "evaluation" not in base.to_dict()  # a training lease reads as it always did

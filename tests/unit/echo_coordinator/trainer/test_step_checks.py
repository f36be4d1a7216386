"""Verification from the training step's own forward (`step_checks`): the same evidence a separate
verification forward gives, a refused batch left out of the gradient, and the samples a step does
not train (advantage 0, a batch too long for one micro-batch) still verified."""

import dataclasses

import numpy as np
import torch

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.samples import TrainSample
from echo_coordinator.trainer.step_checks import Check
from engines.sampler import sample_rows
from tests.unit.echo_coordinator.trainer.test_grpo import samples_for, tiny  # noqa: F401 (fixture)

TOKENS = 8


def honest(trainer, held, group: int, seeds: list[int], rewards: list[float]) -> list[TrainSample]:
    """Samples the nodes holding `held` make with the lease noise `seeds`: one prompt, a token at a time."""
    prompt = tuple(trainer.tokenizer(f"Count to {group}:", add_special_tokens=False).input_ids)
    out = []
    with torch.no_grad(), trainer.holding(held):
        for seed, reward in zip(seeds, rewards):
            ids = list(prompt)
            for position in range(TOKENS):
                last = torch.zeros(1, len(ids), dtype=torch.bool)
                last[0, -1] = True
                row = trainer._scaled_logits(torch.tensor([ids + [0]]), last)
                ids.append(int(sample_rows(row.numpy(), 1.0, [seed], [position])[0][0]))
            out.append(TrainSample(prompt, tuple(ids[len(prompt):]), (0.0,) * TOKENS, (1,) * TOKENS, reward, group))
    with trainer.holding(held):
        logprobs = trainer.logprobs(out)
    return [dataclasses.replace(s, behaviour=tuple(float(x) for x in lp)) for s, lp in zip(out, logprobs)]


def trainer_and_held(tiny, **config):  # noqa: F811
    trainer = Trainer(tiny, TrainerConfig(lora_rank=4, lora_init="random", threads=1, learning_rate=0.01, **config),
                      temperature=1.0)
    held = {k: (v * 0.5).astype(np.float32) for k, v in trainer.weights().items()}  # not the trainer's own
    return trainer, held


def batch(trainer, held) -> tuple[list[TrainSample], list[Check]]:
    """Two leases: an honest one (two groups of 4), and one whose group's tokens are written."""
    seeds = [101, 102, 103, 104, 201, 202, 203, 204]
    good = honest(trainer, held, 0, seeds[:4], [1.0, 0.0, 1.0, 0.0]) + honest(trainer, held, 1, seeds[4:], [0.0, 0.0, 1.0, 0.0])
    written = [dataclasses.replace(s, group=2) for s in samples_for(trainer)[:2]]  # rewards 1 and 0
    samples = good + written
    return samples, [Check(tuple(range(8)), tuple(seeds)), Check((8, 9), (301, 302))]


def test_the_step_finds_what_a_verification_forward_finds(tiny):  # noqa: F811
    trainer, held = trainer_and_held(tiny)
    samples, checks = batch(trainer, held)
    apart = [trainer.evidence([samples[i] for i in c.samples], list(c.seeds), held) for c in checks]
    stats = trainer.step(samples, checks=checks, held=held)
    honest_verdict, cheat = stats.verdicts
    assert honest_verdict.reason is None and cheat.reason in ("bad_sampling", "bad_logprobs")
    assert honest_verdict.free == 8 and cheat.free == 2  # every sample scored from the step's forward
    for verdict, evidence in zip(stats.verdicts, apart):
        for a, b in zip(verdict.evidence, evidence):
            assert a.flips == b.flips and abs(a.max_margin - b.max_margin) < 1e-4
            assert abs(a.mean_logprob_error - b.mean_logprob_error) < 1e-4
    assert all(e.max_margin == 0 for e in honest_verdict.evidence)  # the step ran under `held`, not its own
    assert stats.tokens == 8 * TOKENS and stats.check_seconds > 0  # the written samples left the loss


def test_a_refused_batch_leaves_the_gradient_as_if_it_had_never_come(tiny):  # noqa: F811
    trainer, held = trainer_and_held(tiny)
    samples, checks = batch(trainer, held)
    trainer.step(samples, checks=checks, held=held)
    with_cheat = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    alone, held = trainer_and_held(tiny)
    alone.step(samples[:8], checks=checks[:1], held=held)
    without = {n: p.grad for n, p in alone.model.named_parameters() if p.grad is not None}
    assert with_cheat.keys() == without.keys() and with_cheat
    for name, grad in with_cheat.items():
        # (micro-batches of other padding sum in another order: float noise, not the 11 % of a mean
        # over the written tokens too)
        assert (grad - without[name]).norm() < 1e-4 * without[name].norm(), name


def test_samples_the_step_does_not_train_are_verified_by_a_forward_of_their_own(tiny):  # noqa: F811
    trainer, held = trainer_and_held(tiny)
    samples, checks = batch(trainer, held)
    flat = [dataclasses.replace(s, reward=0.5) for s in samples[4:8]]  # one group all alike: advantage 0
    samples = samples[:4] + flat + samples[8:]
    stats = trainer.step(samples, checks=checks, held=held)
    assert [v.free for v in stats.verdicts] == [4, 2] and stats.verdicts[0].reason is None
    assert stats.verdicts[1].reason is not None

    # A batch no micro-batch holds whole (4 samples x ~14 tokens > 40) is scored apart, then trained.
    trainer, held = trainer_and_held(tiny, micro_batch_tokens=40)
    samples, checks = batch(trainer, held)
    stats = trainer.step(samples, checks=checks, held=held)
    assert stats.verdicts[0].free == 0 and stats.verdicts[0].reason is None and stats.verdicts[1].free == 2
    assert stats.tokens == 8 * TOKENS


def test_with_several_optimiser_steps_checks_are_scored_apart(tiny):  # noqa: F811
    trainer, held = trainer_and_held(tiny, ppo_minibatches=2)
    samples, checks = batch(trainer, held)
    stats = trainer.step(samples, checks=checks, held=held)
    assert [v.free for v in stats.verdicts] == [0, 0]
    assert stats.verdicts[0].reason is None and stats.verdicts[1].reason is not None
    assert stats.tokens == 8 * TOKENS  # the refused batch was never trained

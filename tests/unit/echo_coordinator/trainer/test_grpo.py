"""The RL objective: tests that fail when the advantages, the loss, the importance weights, the
mask or the micro-batching are wrong. The pure parts on hand-made tensors; the trainer's step on
a tiny real model."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.grpo import Objective, group_advantages, grpo_loss, m2po_bound
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.samples import TrainSample
from tests.support.tiny_model import build_tiny_gguf


def test_advantages_are_normalised_within_each_group():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 3.0, 1.0])
    groups = np.array([7, 7, 7, 7, 2, 2, 9, 9])
    a = group_advantages(rewards, groups)
    assert a[:4] == pytest.approx([np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3)], rel=1e-4)
    assert a[4:6].tolist() == [0.0, 0.0]  # no variance, no signal
    assert a[6:] == pytest.approx([1.0, -1.0], rel=1e-4)
    for g in (7, 9):  # zero mean, unit (population) std per group
        assert a[groups == g].mean() == pytest.approx(0, abs=1e-6)
        assert a[groups == g].std() == pytest.approx(1, rel=1e-4)


def loss_of(new, old, behaviour, adv, mask, cap=2.0, eps=0.2):
    new = new.clone().requires_grad_(True)
    out = grpo_loss(new, old, behaviour, adv, mask, int(mask.sum()), eps, Objective(tis_cap=cap))
    out.loss.backward()
    return out, new.grad


def test_gradient_raises_positive_and_lowers_negative_advantage_tokens():
    lp = torch.full((2, 3), -1.0)
    mask = torch.ones(2, 3)
    out, grad = loss_of(lp, lp, lp, torch.tensor([1.0, -1.0]), mask)
    # Gradient descent moves new logprobs against the gradient: up for A > 0, down for A < 0.
    assert (grad[0] < 0).all() and (grad[1] > 0).all()
    assert grad[0] == pytest.approx(torch.full((3,), -1 / 6))  # -w * A / tokens, w = 1 on-policy
    assert out.loss.item() == pytest.approx(0.0, abs=1e-7)  # advantages cancel at ratio 1


def test_importance_weights_and_their_cap():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -1.5, -4.0]])  # pi_old / mu = 1, e^0.5, e^3 (capped at 2)
    out, grad = loss_of(old, old, behaviour, torch.tensor([1.0]), torch.ones(1, 3))
    expected_w = torch.tensor([1.0, np.exp(0.5), 2.0])
    assert grad[0] == pytest.approx(-expected_w / 3, rel=1e-5)
    assert out.clipped_tis == 1
    assert out.mismatch_kl_sum == pytest.approx(sum(np.exp(d) - 1 - d for d in (0.0, 0.5, 3.0)), rel=1e-5)
    assert out.log_ratio_sum == pytest.approx(3.5)


def test_masked_tokens_get_no_gradient_and_do_not_count():
    lp = torch.full((2, 4), -1.0)
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # env tokens, then padding
    behaviour = lp.clone()
    behaviour[mask == 0] = -50.0  # would be capped and counted if the mask leaked
    out, grad = loss_of(lp, lp, behaviour, torch.tensor([1.0, 2.0]), mask)
    assert (grad[mask == 0] == 0).all() and (grad[mask == 1] != 0).all()
    assert out.tokens == 4 and out.clipped_tis == 0 and out.row_tokens == [2, 2]


def test_ratio_clipping_stops_the_gradient_beyond_eps():
    old = torch.full((1, 2), -1.0)
    new = torch.tensor([[-1.0 + 0.5, -1.0 - 0.5]])  # ratios e^0.5 (past 1 + eps) and e^-0.5
    out, grad = loss_of(new, old, old, torch.tensor([1.0]), torch.ones(1, 2))
    assert grad[0, 0] == 0 and grad[0, 1] < 0  # A > 0: the raised token is clipped, the lowered one is not
    assert out.clipped_ratio == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", init_std=0.3)


def samples_for(trainer):
    prompt = tuple(trainer.tokenizer("Say a word:", add_special_tokens=False).input_ids)
    good, bad = (10, 11, 12), (20, 21, 22, 23)
    env = (30, 31, 32)
    return [
        TrainSample(prompt, good, (-1.0,) * 3, (1, 1, 1), 1.0, 0),
        TrainSample(prompt, bad, (-1.0,) * 4, (1, 1, 1, 1), 0.0, 0),
        TrainSample(prompt + (5,), good + env + (13,), (-1.0,) * 7, (1, 1, 1, 0, 0, 0, 1), 1.0, 1),
        TrainSample(prompt + (5,), bad, (-1.0,) * 4, (1, 1, 1, 1), 0.0, 1),
    ]


def completion_logprob(trainer, sample) -> float:
    return float(trainer.logprobs([sample])[0][np.asarray(sample.loss_mask) == 1].sum())


def test_a_step_raises_the_rewarded_completion_and_lowers_the_other(tiny):
    trainer = Trainer(tiny, TrainerConfig(lora_rank=4, learning_rate=0.01, threads=1), temperature=1.0)
    batch = samples_for(trainer)
    before = [completion_logprob(trainer, s) for s in batch]
    stats = trainer.step(batch)
    after = [completion_logprob(trainer, s) for s in batch]
    assert stats.trained_samples == 4 and stats.tokens == 3 + 4 + 4 + 4  # env tokens are not trained
    # Within each group the rewarded completion gains on the other. (Not each sample on its own:
    # Adam's first step moves every weight by about the learning rate, whatever its gradient, so
    # one group's update can lift the other's unrewarded sample, depending on the LoRA init.)
    assert after[0] - after[1] > before[0] - before[1] + 1.0
    assert after[2] - after[3] > before[2] - before[3] + 1.0
    assert after[0] > before[0] and after[1] < before[1]


def gradients(tiny, micro_batch_tokens: int) -> dict[str, torch.Tensor]:
    trainer = Trainer(tiny, TrainerConfig(lora_rank=4, lora_init="random", threads=1,
                                          micro_batch_tokens=micro_batch_tokens), temperature=1.0, seed=3)
    trainer.optimizer.step = lambda: None  # keep the gradients of one step, unapplied
    trainer.step(samples_for(trainer))
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_micro_batches_give_the_gradient_of_one_batch(tiny):
    whole, split = gradients(tiny, 10_000), gradients(tiny, 1)  # one micro-batch vs one sample each
    assert whole.keys() == split.keys() and any(g.abs().sum() > 0 for g in whole.values())
    for name in whole:
        assert torch.allclose(whole[name], split[name], rtol=1e-4, atol=1e-7), name


def test_ppo_epochs_make_the_clip_bind(tiny):
    def step(**ppo):
        trainer = Trainer(tiny, TrainerConfig(lora_rank=4, learning_rate=0.05, threads=1, clip_eps=0.1, **ppo),
                          temperature=1.0)
        batch = samples_for(trainer)
        before = completion_logprob(trainer, batch[0])
        stats = trainer.step(batch)
        return stats, completion_logprob(trainer, batch[0]) - before

    single, _ = step()
    assert single.ratio_clipped_fraction == 0.0  # one optimiser step: ratio 1, nothing to clip
    several, gain = step(ppo_epochs=3, ppo_minibatches=2)
    assert several.ratio_clipped_fraction > 0.1 and gain > 0
    assert several.tokens == single.tokens and several.mismatch_kl == pytest.approx(single.mismatch_kl)


# The corrections for large staleness (grpo.py's docstring): each test fails when its formula is wrong.

def loss_with(objective, new, old, behaviour, adv, mask, eps=0.2):
    new = new.clone().requires_grad_(True)
    out = grpo_loss(new, old, behaviour, adv, mask, int(mask.sum()), eps, objective)
    out.loss.backward()
    return out, new.grad


def test_icepop_leaves_out_tokens_outside_its_range_and_keeps_the_rest_uncapped():
    old = torch.full((1, 4), -1.0)
    behaviour = old - torch.tensor([[0.0, 1.5, -1.0, 2.0]])  # pi_old / mu = 1, e^1.5, e^-1, e^2
    out, grad = loss_with(Objective("icepop", icepop=(0.5, 5.0)), old, old, behaviour, torch.tensor([1.0]),
                          torch.ones(1, 4))
    # e^1.5 = 4.48 is inside [0.5, 5]: weighted in full (TIS would cap it at 2); e^-1 = 0.37 and
    # e^2 = 7.4 are outside: no gradient at all (TIS would weight them 0.37 and 2).
    assert grad[0] == pytest.approx(-torch.tensor([1.0, np.exp(1.5), 0.0, 0.0]) / 4, rel=1e-5)
    assert out.clipped_tis == 2
    assert out.log_ratio_sq_sum == pytest.approx(0 + 1.5**2 + 1 + 4)


def test_m2po_bound_leaves_out_the_fewest_largest_squares():
    squares = torch.tensor([1.0, 0.01, 0.02, 0.01])
    # mean of all 0.26 >= 0.04; without the 1.0 the rest's mean is 0.0133 < 0.04: keep up to 0.02
    assert m2po_bound(squares, 0.04) == pytest.approx(0.02)
    assert m2po_bound(torch.tensor([0.03, 0.01]), 0.04) == float("inf")  # already below: keep all
    assert m2po_bound(torch.tensor([0.5, 0.5]), 0.04) < 0  # no suffix is below: nothing kept
    assert m2po_bound(torch.zeros(0), 0.04) == float("inf")


@pytest.mark.parametrize("seed", range(5))
def test_m2po_bound_is_the_smallest_cut_that_meets_the_threshold(seed):
    squares = torch.from_numpy(np.random.default_rng(seed).lognormal(-4, 2, size=500))
    bound = m2po_bound(squares, 0.04)
    kept, dropped = squares[squares <= bound], squares[squares > bound]
    assert len(kept) and kept.mean() < 0.04
    assert len(dropped)  # (these draws start above the threshold)
    assert torch.cat([kept, dropped.min()[None]]).mean() >= 0.04  # one fewer left out would not do


def test_m2po_weights_kept_tokens_by_their_whole_ratio_without_a_clip():
    old = torch.full((1, 3), -1.0)
    behaviour = old - torch.tensor([[0.1, -0.15, 2.0]])  # squares 0.01, 0.0225, 4: the last is left out
    new = old + torch.tensor([[0.5, 0.0, 0.0]])  # a ratio of e^0.5, past 1 + eps
    objective = Objective("m2po", m2_bound=m2po_bound(torch.tensor([0.01, 0.0225, 4.0]), 0.04))
    out, grad = loss_with(objective, new, old, behaviour, torch.tensor([1.0]), torch.ones(1, 3))
    # token 0: w e^0.1 times ratio e^0.5, not clipped (the clip would zero its gradient)
    assert grad[0] == pytest.approx(-torch.tensor([np.exp(0.1) * np.exp(0.5), np.exp(-0.15), 0.0]) / 3, rel=1e-5)
    assert out.clipped_tis == 1


def m2po_gradients(tiny, micro_batch_tokens: int):
    trainer = Trainer(tiny, TrainerConfig(lora_rank=4, lora_init="random", threads=1, objective="m2po",
                                          micro_batch_tokens=micro_batch_tokens), temperature=1.0, seed=3)
    trainer.optimizer.step = lambda: None
    # Behaviour logprobs near the trainer's, as a node's are, and a few far off, as a stale one's.
    offsets = np.random.default_rng(0).normal(0, 0.05, size=7)
    offsets[[1, 4]] = (1.5, -2.0)
    batch = [replace(s, behaviour=tuple(lp - offsets[: len(lp)]))
             for s, lp in zip(samples_for(trainer), trainer.logprobs(samples_for(trainer)))]
    stats = trainer.step(batch)
    return trainer, batch, stats, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_m2po_step_cuts_over_the_whole_batch_whatever_its_micro_batches(tiny):
    trainer, batch, whole_stats, whole = m2po_gradients(tiny, 10_000)
    _, _, split_stats, split = m2po_gradients(tiny, 1)
    for name in whole:  # (float32 sums in another order; a cut made per micro-batch would differ by far more)
        assert torch.allclose(whole[name], split[name], rtol=1e-3, atol=1e-4 * float(whole[name].abs().max())), name
    # The far-off tokens are left out, and the step says how many and what the second moment was.
    trained = [np.asarray(s.loss_mask) == 1 for s in batch]
    squares = np.concatenate([(lp - np.asarray(s.behaviour))[on] ** 2
                              for s, lp, on in zip(batch, trainer.logprobs(batch), trained)])
    assert whole_stats.log_ratio_m2 == pytest.approx(squares.mean(), rel=1e-4)
    kept = squares <= m2po_bound(torch.from_numpy(squares), 0.04)
    assert 0 < kept.mean() < 1 and any(g.abs().sum() > 0 for g in whole.values())
    assert whole_stats.tis_clipped_fraction == pytest.approx(1 - kept.mean())
    assert split_stats.tis_clipped_fraction == whole_stats.tis_clipped_fraction

"""The GRPO objective with token-level truncated importance sampling (TIS).

Notation, per completion token t of sample i:
    mu_t      behaviour logprob the node recorded while sampling (its weights, often quantized,
              possibly S versions old)
    old_t     logprob under the trainer's weights at the start of this step (no grad)
    new_t     logprob under the weights being optimised (grad)
    A_i       group-relative advantage: (r_i - mean(r_group)) / (std(r_group) + eps)

    w_t      = min(exp(old_t - mu_t), tis_cap)                       detached
    ratio_t  = exp(new_t - old_t)
    loss     = - sum_t m_t * w_t * min(ratio_t * A_i, clip(ratio_t, 1-eps, 1+eps) * A_i) / sum_t m_t

How it departs from vanilla GRPO (DeepSeekMath): (1) samples come from mu, not from pi_old, so
each token's term is reweighted by the truncated ratio pi_old/mu (Ionides 2008; the TIS fix for
rollout/trainer mismatch), which corrects both staleness and quantization mismatch; (2) the
loss is a token-level mean over the whole batch (DAPO), not a mean of per-sequence means;
(3) no KL penalty to a reference model. `m_t` is the loss mask: env-written tokens of
multi-turn episodes are not trained. A step makes `ppo_epochs` passes over the batch in
`ppo_minibatches` optimiser steps each (TrainerConfig); old_t stays the start-of-step logprob, so
the ratio clip binds from the second optimiser step on. The default, one of each, is a single
policy-gradient step with ratio 1.

`objective` chooses how w_t corrects the gap between mu and pi_old (`TrainerConfig.objective`):
    "tis"     w_t = min(exp(old_t - mu_t), tis_cap), as above (the default).
    "icepop"  w_t = exp(old_t - mu_t) where it lies in [low, high], else 0: a token whose two
              probabilities disagree that much is left out of the gradient instead of being
              capped (IcePop, Ling team's Ring-1T report, 2025). The default [0.5, 5] is the
              range as remembered from that report: no stored copy here states it, so it is
              unchecked; the staleness table (docs/protocols.md) did not run IcePop.
    "m2po"    w_t = exp(old_t - mu_t), uncapped, and no ratio clip, but the tokens with the largest
              M2_t = (old_t - mu_t)^2 are left out, the fewest that bring the mean M2 of the rest
              below m2_threshold (0.04 in the paper): a trust region on the second moment of the
              log importance ratio rather than on each ratio (M2PO, Zheng, Zhao and Chen 2025,
              arXiv 2510.01161). The cut is made over the whole optimiser step (`m2po_bound`).

Against a plain in-process GRPO loop (bench/learning.py; docs/protocols.md, "Learning as well as
a plain GRPO loop") the swarm reached 0.80 of the loop's held-out accuracy on two-digit addition
after 20 versions (means over three seeds; below it on two seeds, above on the third: the seed
spread, 0.41, is larger than the gap). The correction is not what differs: the nodes' logprobs
match the trainer's (mismatch KL about 0.003 a token) and the cap never binds, so w_t is about 1
and this loss is the loop's. TIS stays the default because it costs nothing when w is 1 and
bounds the weight when it is not. Nodes that hold the trainer's policy exactly (f32 weights,
fp32 adapter updates) ended closer to the loop on two seeds (0.92 of it against 0.66), within
the spread: whether the Q4_1 compute or the int4 adapter view costs learning is still open.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from echo_coordinator.config import OBJECTIVES

ADV_EPS = 1e-6


def group_advantages(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(N,) rewards and (N,) group ids -> (N,) advantages, zero for groups with no variance."""
    advantages = np.zeros(len(rewards), dtype=np.float32)
    for g in np.unique(groups):
        idx = groups == g
        r = rewards[idx].astype(np.float64)
        advantages[idx] = (r - r.mean()) / (r.std() + ADV_EPS)
    return advantages


@dataclass
class LossParts:
    loss: torch.Tensor  # scalar, carries grad
    tokens: int  # tokens with mask 1
    clipped_tis: int  # tokens whose importance weight was cut: capped (tis) or left out (icepop, m2po)
    clipped_ratio: int  # tokens whose PPO ratio was clipped
    mismatch_kl_sum: float  # sum over tokens of the k3 estimator of KL(mu || pi_old): r - 1 - log r
    log_ratio_sum: float  # sum over tokens of (old - mu)
    log_ratio_sq_sum: float  # sum over tokens of (old - mu)^2: the second moment M2PO bounds
    row_log_ratio: list[float]  # per sequence: sum over its tokens of (old - mu)
    row_tokens: list[int]  # per sequence: trained tokens


def pad_rows(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """(B, length) from rows of at most `length` values, zero-padded on the right."""
    out = torch.zeros((len(rows), length), device=rows[0].device if rows else None)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def pack(samples, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, L) ids and (B, L-1) mask / behaviour logprobs of `TrainSample`s, aligned
    with the next-token predictions: position p predicts token p + 1."""
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), length - 1))
    behaviour = torch.zeros((len(samples), length - 1))
    for row, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[row, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        mask[row, p - 1 : p - 1 + c] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behaviour[row, p - 1 : p - 1 + c] = torch.tensor(s.behaviour, dtype=torch.float32)
    return ids, mask, behaviour


@dataclass(frozen=True)
class Objective:
    """How importance weights are corrected (module docstring); `m2_bound`: for "m2po", the
    largest M2_t kept in this optimiser step (`m2po_bound` over all of its tokens)."""

    name: str = "tis"
    tis_cap: float = 2.0
    icepop: tuple[float, float] = (0.5, 5.0)
    m2_bound: float = float("inf")


def m2po_bound(squares: torch.Tensor, threshold: float) -> float:
    """M2PO's cut over one optimiser step's (N,) values of (old - mu)^2: the largest value kept
    when the fewest largest are left out so that the mean of the rest is below `threshold`."""
    if squares.numel() == 0 or float(squares.mean()) < threshold:
        return float("inf")
    ordered = squares.double().sort(descending=True).values
    rest_means = ordered.flip(0).cumsum(0).flip(0) / torch.arange(len(ordered), 0, -1, dtype=torch.float64)
    below = (rest_means < threshold).nonzero()
    return float(ordered[below[0, 0]]) if len(below) else -1.0  # -1: nothing is kept


def step_m2po_bound(samples, old: list[torch.Tensor], threshold: float) -> float:
    """`m2po_bound` over the trained tokens of a step's samples (`TrainSample`s), from `old`, each
    sample's (L - 1,) start-of-step logprobs."""
    squares = [torch.zeros(0)]
    for s, start in zip(samples, old):
        behaviour = torch.tensor(s.behaviour, dtype=torch.float32)  # (as the trainer packs it: the cut is exact)
        log_w = start[len(s.prompt_ids) - 1 :].cpu() - behaviour
        squares.append(log_w.square()[torch.tensor(s.loss_mask) > 0])
    return m2po_bound(torch.cat(squares), threshold)


def token_weights(log_w: torch.Tensor, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, cut): each token's weight for pi_old / mu = exp(log_w), and where the objective cut it."""
    ratio = torch.exp(log_w)
    if objective.name == "tis":
        cut = ratio > objective.tis_cap
        return ratio.clamp(max=objective.tis_cap), cut
    if objective.name == "icepop":
        low, high = objective.icepop
        cut = (ratio < low) | (ratio > high)
    elif objective.name == "m2po":
        cut = log_w.square() > objective.m2_bound
    else:
        raise ValueError(f"unknown objective {objective.name!r}; one of {', '.join(OBJECTIVES)}")
    return torch.where(cut, torch.zeros_like(ratio), ratio), cut


def grpo_loss(
    new: torch.Tensor,  # (B, T) logprobs with grad
    old: torch.Tensor,  # (B, T)
    behaviour: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) float, 1 where the token is trained
    total_tokens: int,  # masked tokens in the whole batch, so micro-batches sum to the batch mean
    clip_eps: float,
    objective: Objective = Objective(),
) -> LossParts:
    log_w = (old - behaviour).detach()  # (B, T)
    w, cut = token_weights(log_w, objective)
    ratio = torch.exp(new - old.detach())
    adv = advantages[:, None]  # (B, 1)
    surrogate = ratio * adv
    if objective.name != "m2po":  # (M2PO's second-moment bound replaces the ratio clip)
        surrogate = torch.minimum(surrogate, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)  # (B, T)
    loss = -(w * surrogate * mask).sum() / max(total_tokens, 1)
    on = mask > 0
    return LossParts(
        loss=loss,
        tokens=int(on.sum()),
        clipped_tis=int(cut[on].sum()),
        clipped_ratio=int(((ratio - 1).abs() > clip_eps)[on].sum()),
        mismatch_kl_sum=float((torch.exp(log_w) - 1 - log_w)[on].sum()),
        log_ratio_sum=float(log_w[on].sum()),
        log_ratio_sq_sum=float(log_w[on].square().sum()),
        row_log_ratio=(log_w * mask).sum(dim=1).tolist(),
        row_tokens=mask.sum(dim=1).int().tolist(),
    )

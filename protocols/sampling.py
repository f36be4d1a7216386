"""Verifiable sampling: the lease fixes a sample's randomness, so the node has no choice left.

A node samples completion token t as argmax(logits_t / T + g_t), where g_t is a vector of Gumbel
noise drawn from a counter-based generator keyed by the sample's seed and t. Gumbel-max is an exact
sampler of softmax(logits / T), so the behaviour logprob of the token is still log-softmax(logits /
T) at it. The sample seed is a hash of the lease id, the task seed and the sample's index in its
group (`sample_seed`), all chosen by the trainer: given the weights, the prompt and the lease, the
completion is fixed.

The trainer re-derives g_t and compares the node's token with its own logits for the version the
batch claims. An honest node whose weights are quantized differs only where quantization flips a
near tie, so the test is on the *margin* z[a] - z[y] (z = logits / T + g, a the trainer's argmax,
y the node's token): zero where they agree, small at a flipped near tie, typically several units
for a token the model did not sample. `judge` turns a batch's per-sample margins and logprob
errors into a verdict; the thresholds are calibrated on real runs (docs/verification.md).

The generator is SplitMix64 over a Weyl sequence: a pure function of (seed, position, token id),
the same bits on every platform, cheap to vectorise in numpy (node, trainer) or torch (a GPU
trainer could port `_mix` as is).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
OUTLIER_FLIPS = 0.25  # a lone outlier (`judge`) with more of its tokens flipped than this share is written
# A logprob error past this is a "large" one (`SampleEvidence.large_errors`): shading a token's
# logprob by more raises its TIS weight past e^0.5 = 1.65x, so a batch may hold only a few
# (`SamplingRule.max_large_error_fraction`). At 0.25 honest nodes made 1.3-2.7 % of their tokens
# large, too many to tell a shaded handful from (docs/verification.md).
LARGE_LOGPROB_ERROR = 0.5
LARGE_ERRORS_FREE = 3  # large errors any batch may hold besides its share: small leases'
# The per-batch rates are judged on POOL tokens at least: a smaller batch's flip share and mean
# logprob error vary more, by sqrt(POOL / tokens) (their standard error), and its allowances widen
# by as much. A mixture of experts' routing flips cluster, and honest tiny-MoE leases of 1-4
# samples were refused at 0.05-0.2 % under fixed thresholds (docs/verification.md).
POOL = 256
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


def sample_seed(lease_id: str, task_seed: int, index: int) -> int:
    """The seed of sample `index` (0..G-1) of `task_seed` in lease `lease_id`: 64 bits."""
    return int.from_bytes(hashlib.sha256(f"{lease_id}/{task_seed}/{index}".encode()).digest()[:8], "big")


# What a training lease's noise derives from (`TaskLease.noise`), beside each sample's seed: the
# run's, not the lease's or the version's. Task seeds are never reused within a run, so a seed one
# key leaves to lapse is sampled by whoever answers it next with the same noise, at any version:
# leaving the seeds that scored badly re-rolls nothing (selective reporting, issue 36 point 4). In
# async mode a seed reissued after the trainer moved on differs only as much as the policy did.
TRAINING_NOISE = "train"


def sample_seeds(lease_id: str, task_seeds: Sequence[int]) -> list[int]:
    """The seed of each sample of a batch whose task seeds are `task_seeds`, in batch order (the
    order the node generates them in): a sample's index is its place among its seed's samples,
    so G copies of one completion cannot all pass. Node and verifier both call this."""
    seen: dict[int, int] = {}
    seeds = []
    for task_seed in task_seeds:
        index = seen.get(task_seed, 0)
        seen[task_seed] = index + 1
        seeds.append(sample_seed(lease_id, task_seed, index))
    return seeds


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (multiplication wraps, as the algorithm wants)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def row_keys(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """(R,) uint64 key of each row: the noise stream of sample `seeds[r]` at completion position `positions[r]`."""
    positions = np.asarray(positions, dtype=np.uint64)
    seeds = np.array([s % 2**64 for s in seeds], dtype=np.uint64)
    return _mix(seeds ^ _mix(positions * GOLDEN + GOLDEN))


def uniforms(seed: int, positions: np.ndarray | list[int], vocab: int) -> np.ndarray:
    """(len(positions), vocab) float64 uniforms in (0, 1) of one sample's completion positions,
    never 0 or 1: SplitMix64 of the row's key plus (token id + 1) x the golden gamma, top 53 bits."""
    keys = row_keys([seed] * len(positions), positions)  # (P,)
    bits = _mix(keys[:, None] + np.arange(1, vocab + 1, dtype=np.uint64)[None, :] * GOLDEN)  # (P, V)
    return ((bits >> _S11).astype(np.float64) + 0.5) * 2.0**-53


def gumbel(seed: int, positions: np.ndarray | list[int], vocab: int) -> np.ndarray:
    """(len(positions), vocab) float64 Gumbel(0, 1) noise of one sample's completion positions.
    The definition, written plainly: `engines.sampler` computes the same at compiled speed."""
    return -np.log(-np.log(uniforms(seed, positions, vocab)))


def noise(seed: int | None, positions: np.ndarray | list[int], vocab: int) -> np.ndarray:
    """A sample's noise at completion `positions`: its Gumbel noise, or zeros when `seed` is None,
    which is greedy decoding (evaluation leases ask for it); greedy is checked the same way."""
    if seed is None:
        return np.zeros((len(positions), vocab))
    return gumbel(seed, positions, vocab)


def choose(scaled_logits: np.ndarray, noise: np.ndarray) -> int:
    """The sampled token: argmax of logits / T plus the position's Gumbel noise."""
    return int(np.argmax(scaled_logits + noise))


def log_softmax(scaled_logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (the behaviour logprobs the node reports)."""
    rows = np.asarray(scaled_logits, dtype=np.float64)
    rows = rows - rows.max(axis=-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))


def margins(scaled_logits: np.ndarray, noise: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(T,) how far each token is from what these logits would have sampled: z[argmax] - z[token] >= 0."""
    z = scaled_logits.astype(np.float64) + noise  # (T, V)
    return z.max(axis=1) - z[np.arange(len(tokens)), tokens]


# ------------------------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class SamplingRule:
    """Thresholds that separate a quantized honest node from a node that chose its tokens.
    Per token: the largest margin and logprob error any one token may have. Per batch (a lease's
    samples, pooled, so the test has hundreds of tokens to go on): the share of tokens that differ
    from the trainer's argmax, and the mean logprob error. Calibrated in docs/verification.md."""

    # Per token: about twice the p99.9 honest Q4_1, Q8_0 and transformers nodes showed against the
    # fp32 trainer (SmolLM2-135M, T = 1; docs/verification.md), the rare larger one a lone
    # outlier (the coordinator's `OutlierBudget`); per batch: about twice the honest rates. Well below every cheat's.
    # Large logprob errors: honest nodes made 0.04-0.12 % of tokens large, at most 0.45 % of a
    # lease's; LARGE_ERRORS_FREE + 1 % leaves an honest 16-sample lease 5e-7 odds of a refusal.
    max_margin: float = 1.5
    max_logprob_error: float = 2.5
    max_flip_fraction: float = 0.10
    mean_logprob_error: float = 0.12
    max_large_error_fraction: float = 0.01

    def __post_init__(self):
        for name in ("max_margin", "max_logprob_error", "max_flip_fraction", "mean_logprob_error",
                     "max_large_error_fraction"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise ValueError(f"sampling rule {name} must be a positive number, got {value!r}")

    def outlier(self, e: SampleEvidence) -> bool:
        """A sample holding a token past `max_margin` or `max_logprob_error` (`judge`)."""
        return e.max_margin > self.max_margin or e.max_logprob_error > self.max_logprob_error


@dataclass(frozen=True)
class SampleEvidence:
    """What the trainer measured of one sample's model tokens (env tokens excluded)."""

    tokens: int
    max_margin: float
    flips: int  # tokens with a non-zero margin
    max_logprob_error: float
    mean_logprob_error: float
    large_errors: int = 0  # tokens whose logprob error is past LARGE_LOGPROB_ERROR

    @classmethod
    def of(cls, margins: np.ndarray, trainer_logprobs: np.ndarray, behaviour: np.ndarray) -> SampleEvidence:
        """From each model token's margin and the trainer's logprob of it (`engines.sampler.score_rows`)
        and the node's behaviour logprobs."""
        m = np.asarray(margins, np.float64)
        error = np.abs(np.asarray(behaviour, np.float64) - np.asarray(trainer_logprobs, np.float64))
        return cls(tokens=len(m), max_margin=float(m.max(initial=0.0)), flips=int((m > 0).sum()),
                   max_logprob_error=float(error.max(initial=0.0)),
                   mean_logprob_error=float(error.mean()) if len(m) else 0.0,
                   large_errors=int((error > LARGE_LOGPROB_ERROR).sum()))


def judge(batch: list[SampleEvidence], rule: SamplingRule) -> str | None:
    """None for a batch an honest node could have produced, else the reason code.

    A batch whose tokens' logprob errors are small on average but with more than a few past
    LARGE_LOGPROB_ERROR is shading chosen tokens: `bad_logprobs`, as a shaded mean is.
    A sample with a token past `max_margin` or `max_logprob_error` is an *outlier*. Honest nodes
    make one in about 5,000 samples (an activation outlier that llama.cpp's 8-bit activation blocks
    round badly, docs/verification.md), never two in one batch, and never with more than a quarter
    of its tokens flipped. A second outlier, or a sample that is mostly written, is a cheat
    (`bad_sampling`, `bad_logprobs`). A lone outlier could be either: an honest one, or one sample's
    answer written. So its batch is refused as `outlier`, and the key's history decides whether it is
    a strike (`echo_coordinator.trust.OutlierBudget`): a batch with a written token is never accepted."""
    tokens = sum(e.tokens for e in batch)
    flips = sum(e.flips for e in batch)
    mean_error = sum(e.mean_logprob_error * e.tokens for e in batch) / max(tokens, 1)
    outliers = [e for e in batch if rule.outlier(e)]
    widen = np.sqrt(POOL / max(tokens, 1)) if tokens < POOL else 1.0
    # One flipped near tie is always allowed: a one-token answer may hinge on it.
    if flips > 1 + rule.max_flip_fraction * widen * tokens:
        return "bad_sampling"
    if len(outliers) > 1 or any(e.flips > 1 + OUTLIER_FLIPS * e.tokens for e in outliers):
        return "bad_sampling" if any(e.max_margin > rule.max_margin for e in outliers) else "bad_logprobs"
    if mean_error > rule.mean_logprob_error * widen:
        return "bad_logprobs"
    # The mean alone lets a few tokens be shaded far, each to the TIS cap (docs/verification.md).
    if sum(e.large_errors for e in batch) > LARGE_ERRORS_FREE + rule.max_large_error_fraction * tokens:
        return "bad_logprobs"
    return "outlier" if outliers else None

"""Verifiable Gumbel-max sampling: the noise, the sampler's exactness and the margin verdict."""

import numpy as np
import pytest

from protocols.sampling import (
    SampleEvidence, SamplingRule, choose, gumbel, judge, log_softmax, margins, sample_seed,
)


def test_noise_is_a_pure_function_of_seed_position_and_token():
    a = gumbel(7, [0, 1, 5], 1000)
    assert a.shape == (3, 1000) and np.array_equal(a, gumbel(7, [0, 1, 5], 1000))
    assert np.array_equal(a[2], gumbel(7, [5], 1000)[0])  # a row does not depend on its neighbours
    assert np.array_equal(a[:, :10], gumbel(7, [0, 1, 5], 10))  # nor on the vocabulary size
    assert not np.array_equal(a[0], gumbel(8, [0], 1000)[0]) and not np.array_equal(a[0], a[1])
    assert gumbel(2**64 - 1, [2**40], 4).shape == (1, 4)  # the whole seed and position ranges work


def test_noise_is_standard_gumbel():
    g = gumbel(3, np.arange(40), 5000).ravel()  # 200k draws
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - np.pi**2 / 6) < 0.03
    assert np.isfinite(g).all()


def test_gumbel_max_samples_softmax_exactly():
    """The behaviour logprob stays exact only if argmax(logits/T + g) ~ softmax(logits/T)."""
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0])
    probs = np.exp(log_softmax(logits))
    draws = 20000
    picks = np.array([choose(logits, row) for row in gumbel(11, np.arange(draws), len(logits))])
    freq = np.bincount(picks, minlength=len(logits)) / draws
    assert np.abs(freq - probs).max() < 4 * np.sqrt(probs.max() * (1 - probs.max()) / draws)


def test_sample_seeds_differ_by_lease_seed_and_index():
    seeds = {sample_seed(lease, s, j) for lease in ("a-1", "a-2") for s in (1, 2) for j in range(4)}
    assert len(seeds) == 16 and all(0 <= x < 2**64 for x in seeds)


def test_margins_are_zero_for_what_the_logits_sample_and_positive_otherwise():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50))
    noise = gumbel(5, np.arange(6), 50)
    sampled = np.array([choose(r, g) for r, g in zip(logits, noise)])
    assert np.array_equal(margins(logits, noise, sampled), np.zeros(6))
    other = (sampled + 1) % 50
    assert (margins(logits, noise, other) > 0).all()


def evidence(max_margin=0.0, flips=0, tokens=20, max_err=0.01, mean_err=0.005, large=0):
    return SampleEvidence(tokens, max_margin, flips, max_err, mean_err, large)


@pytest.mark.parametrize("batch, verdict", [
    ([evidence()] * 4, None),
    ([evidence(max_margin=0.2, flips=2)] * 4, None),  # a few quantization-flipped near ties
    # A lone outlier: honest (an activation outlier) or one sample's answer written; the key's history decides.
    ([evidence()] * 3 + [evidence(max_margin=3.5, flips=2, max_err=3.4)], "outlier"),
    ([evidence()] * 3 + [evidence(max_err=3.0)], "outlier"),
    ([evidence()] * 2 + [evidence(max_margin=3.5, flips=1)] * 2, "bad_sampling"),  # two: written tokens
    ([evidence()] * 3 + [evidence(max_margin=3.5, flips=10)], "bad_sampling"),  # a mostly written sample
    ([evidence(max_margin=0.5, flips=6)] * 4, "bad_sampling"),  # many small flips: another temperature, say
    ([evidence()] * 2 + [evidence(max_err=3.0)] * 2, "bad_logprobs"),
    ([evidence(mean_err=0.3, max_err=0.4)] * 4, "bad_logprobs"),  # every logprob shaded down a little
    ([evidence(max_margin=0.4, flips=1, tokens=1)], None),  # a one-token answer may hinge on one near tie
    ([evidence(mean_err=0.3, max_err=0.4, tokens=2)] + [evidence(tokens=40)] * 3, None),  # the mean is per token
    # Concentrated shading: a few tokens shaded far (each to the TIS cap), the mean still honest-looking.
    ([evidence(tokens=100, max_err=2.4, mean_err=0.07, large=3)] * 4, "bad_logprobs"),
    ([evidence(tokens=100, max_err=0.9, mean_err=0.05, large=1)] * 2 + [evidence(tokens=100)] * 2, None),  # honest: rare
    # A small batch's rates vary more (by sqrt(POOL / tokens)): what an honest 64-token lease of a
    # mixture of experts showed passes, the same rates over POOL tokens do not.
    ([evidence(tokens=16, max_margin=0.4, flips=3)] * 3 + [evidence(tokens=16)], None),
    ([evidence(tokens=16, max_margin=0.4, flips=3)] * 12 + [evidence(tokens=16)] * 4, "bad_sampling"),
    ([evidence(tokens=16, mean_err=0.15, max_err=0.4)] * 4, None),
    ([evidence(tokens=16, mean_err=0.15, max_err=0.4)] * 16, "bad_logprobs"),
    ([evidence(tokens=16, mean_err=0.3, max_err=0.4)] * 4, "bad_logprobs"),  # shading 0.3 still shows in 64 tokens
])
def test_judge(batch, verdict):
    assert judge(batch, SamplingRule()) == verdict


def test_evidence_pools_a_samples_margins_and_logprob_errors():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(150, 40)) * 3
    positions = np.arange(150) * 2  # e.g. model tokens between env tokens
    noise = gumbel(9, positions, 40)
    tokens = np.array([choose(r, g) for r, g in zip(logits, noise)])
    tokens[[3, 77]] = (tokens[[3, 77]] + 1) % 40
    trainer = log_softmax(logits)[np.arange(150), tokens]
    m = margins(logits, noise, tokens)
    e = SampleEvidence.of(m, trainer, trainer - 0.01)
    assert (e.tokens, e.flips) == (150, 2) and e.max_margin == pytest.approx(m.max())
    assert e.max_logprob_error == pytest.approx(0.01) and e.mean_logprob_error == pytest.approx(0.01)


def test_rule_thresholds_must_be_positive():
    with pytest.raises(ValueError, match="max_margin"):
        SamplingRule(max_margin=0)

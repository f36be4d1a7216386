"""The compiled sampler and the device verifier compute exactly protocols.sampling's definition."""

import numpy as np
import pytest
import torch

from engines import device_sampler, sampler
from protocols.sampling import gumbel, log_softmax, margins


def rows_of(rng, count, vocab, spread):
    """float32 logits: `spread` wide, a few peaked rows and a flat one (every entry a near tie)."""
    rows = (rng.standard_normal((count, vocab)) * spread).astype(np.float32)
    rows[0] = 0.0  # flat: every entry passes the filter's bound
    rows[1, 7] += 30.0  # one token certain
    return rows


@pytest.mark.parametrize("vocab,spread,temperature", [(1000, 3.0, 1.0), (5000, 1.0, 0.7), (49152, 4.0, 1.3)])
def test_sample_rows_is_gumbel_max_of_the_definition(vocab, spread, temperature):
    rng = np.random.default_rng(vocab)
    rows = rows_of(rng, 12, vocab, spread)
    seeds = [int(s) for s in rng.integers(0, 2**63, 12)]
    positions = list(range(3, 15))
    tokens, logprobs = sampler.sample_rows(rows, temperature, seeds, positions)
    for r in range(len(rows)):
        scaled = rows[r].astype(np.float64) / temperature
        expected = int(np.argmax(scaled + gumbel(seeds[r], [positions[r]], vocab)[0]))
        assert tokens[r] == expected
        assert logprobs[r] == pytest.approx(log_softmax(scaled)[expected], abs=1e-5)
    assert tokens[1] == 7


def test_greedy_rows_take_the_largest_logit():
    rows = rows_of(np.random.default_rng(1), 4, 300, 2.0)
    tokens, _ = sampler.sample_rows(rows, 1.0, [None, 5, None, None], [0, 0, 0, 0])
    assert tokens[0] == 0 and tokens[2] == rows[2].argmax() and tokens[3] == rows[3].argmax()


def test_rows_of_one_batch_do_not_share_noise():
    rows = np.zeros((2, 4096), np.float32)  # identical flat rows: only the noise tells them apart
    assert len(set(sampler.sample_rows(rows, 1.0, [1, 2], [0, 0])[0].tolist())) == 2
    assert len(set(sampler.sample_rows(rows, 1.0, [1, 1], [0, 1])[0].tolist())) == 2
    same = sampler.sample_rows(rows, 1.0, [1, 1], [5, 5])[0]
    assert same[0] == same[1]


def test_margins_match_the_definition_and_are_zero_where_the_node_agrees():
    rng = np.random.default_rng(3)
    vocab = 3000
    scaled = rows_of(rng, 20, vocab, 2.0)
    seeds = [11] * 10 + [None] * 2 + [12] * 8
    positions = np.arange(20)
    tokens = rng.integers(0, vocab, 20)
    agreed, _ = sampler.sample_rows(scaled[:5], 1.0, seeds[:5], list(positions[:5]))
    tokens[:5] = agreed
    got, trainer = sampler.score_rows(scaled, seeds, positions, tokens)
    for r in range(20):
        noise = np.zeros((1, vocab)) if seeds[r] is None else gumbel(seeds[r], [r], vocab)
        want = margins(scaled[r : r + 1], noise, tokens[r : r + 1])[0]
        assert got[r] == pytest.approx(want, abs=1e-9)
        assert trainer[r] == pytest.approx(log_softmax(scaled[r].astype(np.float64))[tokens[r]], abs=1e-5)
    assert (got[:5] == 0).all() and (got[5:] > 0).sum() >= 10


def test_flat_rows_cost_the_scan_no_more_noise_than_peaked_ones():
    """The bound rises with the best z found, so a row whose every entry is a near tie (a node can
    drive the context there) gets its noise computed exactly at a few dozen entries, as a peaked
    row does: not at the ~e^-g / p_top a fixed bound lets through (all of them, here)."""
    rng = np.random.default_rng(8)
    vocab, n = 151_936, 64
    flat = (rng.standard_normal((n, vocab)) * 1e-3).astype(np.float32)  # random-token context: near uniform
    peaked = (rng.standard_normal((n, vocab)) * 3.0).astype(np.float32)
    peaked[np.arange(n), rng.integers(0, vocab, n)] += 12.0
    seeds = [int(s) for s in rng.integers(0, 2**63, n)]
    positions = np.arange(n)
    tokens = rng.integers(0, vocab, n)
    hostile = sampler.exact_evaluations(flat, seeds, positions, tokens)
    honest = sampler.exact_evaluations(peaked, seeds, positions, tokens)
    assert np.median(hostile) <= 60 and hostile.max() <= 200, (np.median(hostile), hostile.max())
    assert honest.max() <= 200
    # and the margins are still the definition's
    got, _ = sampler.score_rows(flat[:3], seeds[:3], positions[:3], tokens[:3])
    for r in range(3):
        want = margins(flat[r : r + 1], gumbel(seeds[r], [r], vocab), tokens[r : r + 1])[0]
        assert got[r] == pytest.approx(want, abs=1e-12)


def test_the_scorer_on_the_cpu_is_the_compiled_scan():
    rng = np.random.default_rng(4)
    scaled = rows_of(rng, 40, 2048, 3.0)
    seeds = [int(s) for s in rng.integers(0, 2**63, 40)]
    seeds[3] = None
    positions, tokens = np.arange(40) + 2, rng.integers(0, 2048, 40)
    compiled = sampler.score_rows(scaled, seeds, positions, tokens)
    scoring = device_sampler.Scoring(torch.device("cpu"), seeds, positions, tokens)
    for a in range(0, 40, 16):  # chunk by chunk, as verification's forward makes them
        scoring.add(torch.from_numpy(scaled[a : a + 16]))
    got = scoring.result(lambda rows: torch.from_numpy(scaled[rows]))
    assert np.array_equal(got[0], compiled[0]) and np.array_equal(got[1], compiled[1])


def test_noise_at_single_entries_is_the_definitions():
    ids = [0, 17, 2999]
    got = sampler.noise_at([9, 9, 10], [4, 4, 0], ids)
    assert got[0] == pytest.approx(gumbel(9, [4], 3000)[0, 0], abs=1e-12)
    assert got[1] == pytest.approx(gumbel(9, [4], 3000)[0, 17], abs=1e-12)
    assert got[2] == pytest.approx(gumbel(10, [0], 3000)[0, 2999], abs=1e-12)

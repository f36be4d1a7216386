"""The verifier's scoring as it was before issue 34 (commit 9561ffe), kept so that
`bench/verification_cost.py` measures the new path against it in one run. Not used by the
project. The compiled scan fixed its filter bound before the scan (z* = z at the largest logit
and the node's token), so a flat row let ~e^-g / p_top entries through to exact noise; the device
path ran the same fixed-bound filter in unfused torch ops and took every candidate through Python.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from engines.sampler import SLACK, _apply_threads, _exps, _mix, _noise, noise_at
from protocols.sampling import GOLDEN, row_keys

CHUNK_ENTRIES = 1 << 23


@numba.njit(cache=True)
def _filter(key, exps, bound, keep):
    """keep[i]: entry i may beat the bound. With hi the top 32 bits of its hash and
    c = (2^32 - 1 - hi) >> 1, 1 - u_i > c * 2^-31; so c >= exps_i * bound (bound = 2^31 x
    exp(top / T - z*) x (1 + SLACK)) rules it out. A flag per entry vectorises (a list of the
    few kept ones would not), and apart from `_exps` (mixing float32 and uint64 lanes does not)."""
    x = key
    for i in range(exps.shape[0]):
        x += np.uint64(GOLDEN)
        c = np.int32((np.uint64(0xFFFFFFFF) - (_mix(x) >> np.uint64(32))) >> np.uint64(1))
        keep[i] = np.float32(c) < exps[i] * bound


@numba.njit(cache=True)
def _scan(row, t, key, noisy, chosen, largest, exps, keep):
    """(argmax of z = row / t + g, its z, z at `chosen` (-1: none), log-sum-exp of row / t) for
    one row; g = 0 unless `noisy` (greedy). `largest`: the row's argmax (numpy's: a max loop here
    does not vectorise, 7x slower). `exps`, `keep`: scratch of the row's length."""
    best = largest
    top = row[best]
    best_z = np.float64(top) / t + (_noise(key, best) if noisy else 0.0)
    chosen_z = 0.0
    if chosen >= 0:
        chosen_z = np.float64(row[chosen]) / t + (_noise(key, chosen) if noisy else 0.0)
        if chosen_z > best_z:
            best, best_z = chosen, chosen_z
    bound = np.float32(np.exp(np.float64(top) / t - best_z) * (1.0 + SLACK) * 2.0**31) if noisy else np.float32(0.0)
    total = _exps(row, np.float32(1.0 / t), top, exps)
    lse = np.float64(top) / t + np.log(np.float64(total))
    if noisy:
        _filter(key, exps, bound, keep)
        words = keep.view(np.uint64)  # 8 flags a word: the kept few are found 8 entries at a time
        for w in range(words.shape[0]):
            if words[w]:
                for i in range(8 * w, min(8 * w + 8, row.shape[0])):
                    if keep[i]:
                        z = np.float64(row[i]) / t + _noise(key, i)
                        if z > best_z:
                            best, best_z = i, z
    return best, best_z, chosen_z, lse


@numba.njit(parallel=True, cache=True)
def _scan_rows(rows, t, keys, noisy, chosen, largest, best, margins, lse, threads):
    """`_scan` of every row, on numba's threads: best[r], margins[r] (best z - chosen z), lse[r].
    Each thread takes every n-th row with scratch of its own, allocated once (fresh pages for
    every row cost as much as the scan)."""
    for first in numba.prange(threads):
        exps, keep = np.empty(rows.shape[1], np.float32), np.zeros(-(-rows.shape[1] // 8) * 8, np.bool_)
        for r in range(first, rows.shape[0], threads):
            best[r], best_z, chosen_z, lse[r] = _scan(rows[r], t, keys[r], noisy[r], chosen[r], largest[r], exps, keep)
            margins[r] = best_z - chosen_z



def score_rows(scaled: np.ndarray, seeds, positions, tokens) -> tuple[np.ndarray, np.ndarray]:
    """The old `engines.sampler.score_rows`."""
    rows = np.ascontiguousarray(scaled, dtype=np.float32)
    tokens = np.asarray(tokens, dtype=np.int64)
    _apply_threads()
    n = len(rows)
    noisy = np.array([s is not None for s in seeds], dtype=np.bool_)
    keys = row_keys([s or 0 for s in seeds], [int(p) for p in positions])
    best, margins, lse = np.empty(n, np.int64), np.empty(n), np.empty(n)
    _scan_rows(rows, 1.0, keys, noisy, tokens, rows.argmax(axis=1), best, margins, lse,
               max(1, min(n, numba.get_num_threads())))
    return margins, rows[np.arange(n), tokens].astype(np.float64) - lse


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _M2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(int(GOLDEN))


def _tshift(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _tmix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _tshift(x, 30)) * _M1
    x = (x ^ _tshift(x, 27)) * _M2
    return x ^ _tshift(x, 31)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, V) float64 u of every entry of rows keyed `keys` (int64 view of the uint64 keys)."""
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _GOLDEN
    return (_tshift(_tmix(keys[:, None] + ids[None, :]), 11).double() + 0.5) * 2.0**-53


def score_on_device(scaled: torch.Tensor, seeds: list[int | None], positions: np.ndarray, tokens: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """`score_rows` with the filter on `scaled`'s device (a GPU's; any device in tests)."""
    n, vocab = scaled.shape
    device = scaled.device
    y = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=device)
    top, best = scaled.max(dim=1)
    exps = torch.exp(scaled - top[:, None])  # (N, V) float32, as the node's
    lse = (top.double() + torch.log(exps.double().sum(dim=1))).cpu().numpy()
    chosen = scaled.gather(1, y[:, None])[:, 0].double()
    chosen_host = chosen.cpu().numpy()
    margins = (top.double() - chosen).cpu().numpy()  # greedy rows: no noise
    noisy = [r for r, s in enumerate(seeds) if s is not None]
    if not noisy:
        return margins, chosen_host - lse
    keys_u64 = row_keys([seeds[r] for r in noisy], [int(positions[r]) for r in noisy])
    keys = torch.as_tensor(keys_u64.view(np.int64), device=device)
    rows = torch.as_tensor(noisy, device=device)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (row in `noisy`, id, logit)
    step = max(1, CHUNK_ENTRIES // vocab)
    for a in range(0, len(noisy), step):
        k, r = keys[a : a + step], rows[a : a + step]
        u = uniforms(k, vocab)  # (C, V)
        # z* >= z at the largest logit and at the node's token, from torch's logs: a bound only
        z_top = top[r].double() - torch.log(-torch.log(u.gather(1, best[r][:, None])[:, 0]))
        z_y = chosen[r] - torch.log(-torch.log(u.gather(1, y[r][:, None])[:, 0]))
        scale = torch.exp(top[r].double() - torch.maximum(z_top, z_y)) * (1.0 + 2 * SLACK)
        keep = (1.0 - u) < exps[r].double() * scale[:, None]
        keep.scatter_(1, best[r][:, None], True)
        keep.scatter_(1, y[r][:, None], True)
        at, ids = keep.nonzero(as_tuple=True)
        found.append(((at + a).cpu().numpy(), ids.cpu().numpy(), scaled[r[at], ids].double().cpu().numpy()))
    at, ids, logits = (np.concatenate(x) for x in zip(*found))
    z = logits + noise_at([seeds[noisy[i]] for i in at], [int(positions[noisy[i]]) for i in at], ids.tolist())
    best_z = np.full(len(noisy), -np.inf)
    np.maximum.at(best_z, at, z)
    node_z = z[ids == np.asarray(tokens)[np.asarray(noisy)][at]]  # one per row: y was kept
    margins[noisy] = best_z - node_z
    return margins, chosen_host - lse


class Scoring:
    """`engines.device_sampler.Scoring`'s interface over the old scorers, for the evidence loop:
    each chunk scored when it comes (the old loop's one sync and Python pass a chunk)."""

    def __init__(self, device, seeds, positions, tokens):
        self.seeds, self.positions, self.tokens = seeds, np.asarray(positions), np.asarray(tokens)
        self.margins, self.logprobs, self.done = np.empty(len(tokens)), np.empty(len(tokens)), 0

    def add(self, scaled: torch.Tensor) -> None:
        rows = slice(self.done, self.done + len(scaled))
        self.done = rows.stop
        args = (self.seeds[rows], self.positions[rows], self.tokens[rows])
        self.margins[rows], self.logprobs[rows] = (score_rows(scaled.detach().numpy(), *args) if scaled.device.type == "cpu"
                                                   else score_on_device(scaled, *args))

    def result(self, logits_of) -> tuple[np.ndarray, np.ndarray]:
        return self.margins, self.logprobs

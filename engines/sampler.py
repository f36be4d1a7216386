"""Verifiable Gumbel-max at compiled speed, over a batch of rows: the node's sampler and the CPU
trainer's verifier (`protocols.sampling` is the definition; this computes exactly it).

The definition takes two logarithms per vocabulary entry (g = -log(-log u)); here they are taken
only where they can matter. With z = l / T + g and E = -log u, an entry beats a value z* only if
E_i < exp(l_i / T - z*), and E_i >= 1 - u_i, so an entry with 1 - u_i >= exp(l_i / T - z*) cannot
beat z*. Take z* = z at the largest logit: the exp is the softmax's (the behaviour logprob needs
it anyway), so per entry what is left is the hash and a compare. About 1 + e^-g entries per row
pass (g the largest logit's noise) and get their noise computed exactly, by the one compiled
function (`_noise`) that node and trainer both call, so both see the same bits. The filter keeps a
relative slack of `SLACK`, far above the rounding of float32 exps; an extra candidate costs a log.

`sample_rows` (node): token and behaviour logprob of each row. `score_rows` (trainer): the margin
of each node token under its own logits and its logprob. Rows run in parallel on numba's threads.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from protocols.sampling import GOLDEN, row_keys

SLACK = 1e-3  # relative, on the filter's bound: the fast exp is good to ~1e-5 (float32 arguments), 100x less
FAST = {"reassoc", "nsz", "arcp", "contract", "nnan", "ninf"}  # vectorised max, exp and sum (not the noise)
_threads = 0  # numba threads the scans use; 0: all numba started with (`use_threads`)


@intrinsic
def _float_of_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits` (vectorises; numba has no scalar view)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


@numba.njit(inline="always")
def _mix(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(inline="always")
def _noise(key, i):
    """g of vocabulary entry i: protocols.sampling.gumbel's, computed alike."""
    bits = _mix(key + np.uint64(i + 1) * np.uint64(GOLDEN))
    return -np.log(-np.log((np.float64(bits >> np.uint64(11)) + 0.5) * 2.0**-53))


@numba.njit(fastmath=FAST, cache=True)
def _exps(row, inv_t, top, out):
    """out = exp((row - top) * inv_t) in float32, and its sum in float64: 2^y as 2^n (exponent
    bits, n = round(y)) times the degree-6 Taylor polynomial of 2^f, |f| <= 1/2 (relative error
    ~1e-7), clamped at 2^-126."""
    total = 0.0
    for i in range(row.shape[0]):
        y = max((row[i] - top) * inv_t, np.float32(-87.0)) * np.float32(1.4426950408889634)
        n = np.rint(y)
        f = y - n
        p = np.float32(1.0) + f * (np.float32(0.6931472) + f * (np.float32(0.2402265) + f * (np.float32(0.05550411)
            + f * (np.float32(0.009618129) + f * (np.float32(0.001333356) + f * np.float32(0.0001540353))))))
        value = p * _float_of_bits((np.int32(n) + np.int32(127)) << np.int32(23))
        out[i] = value
        total += np.float64(value)
    return total


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


@numba.njit(parallel=True, cache=True)
def _noise_at(keys, ids, out):
    for r in numba.prange(ids.shape[0]):
        out[r] = _noise(keys[r], ids[r])


def use_threads(threads: int) -> None:
    """Run the scans on at most `threads` threads (0: all cores), as the backend's own setting.
    numba's setting is per calling thread, so every call applies it."""
    global _threads
    _threads = min(threads, numba.config.NUMBA_NUM_THREADS) if threads else 0


def _apply_threads() -> None:
    numba.set_num_threads(_threads or numba.config.NUMBA_NUM_THREADS)


def _scan_all(rows: np.ndarray, temperature: float, seeds: list[int | None], positions, chosen: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    _apply_threads()
    n = len(rows)
    noisy = np.array([s is not None for s in seeds], dtype=np.bool_)
    keys = row_keys([s or 0 for s in seeds], [int(p) for p in positions])
    best, margins, lse = np.empty(n, np.int64), np.empty(n), np.empty(n)
    largest = rows.argmax(axis=1)
    _scan_rows(rows, float(temperature), keys, noisy, chosen, largest, best, margins, lse,
               max(1, min(n, numba.get_num_threads())))
    return best, margins, lse


def sample_rows(rows: np.ndarray, temperature: float, seeds: list[int | None], positions: list[int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, behaviour logprobs) of each row of float32 logits `rows` (R, V): Gumbel-max with
    sample `seeds[r]`'s noise at completion position `positions[r]` (seed None: greedy)."""
    tokens, _, lse = _scan_all(rows, temperature, seeds, positions, np.full(len(rows), -1, np.int64))
    return tokens, rows[np.arange(len(rows)), tokens].astype(np.float64) / temperature - lse


def score_rows(scaled: np.ndarray, seeds: list[int | None], positions: np.ndarray, tokens: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(margins, logprobs) of node `tokens` under float32 logits / T `scaled` (N, V): how far each
    is from what these logits sample with the noise of `seeds[r]` at `positions[r]` (None: greedy,
    no noise), and its log-softmax."""
    tokens = np.asarray(tokens, dtype=np.int64)
    _, margins, lse = _scan_all(scaled, 1.0, seeds, positions, tokens)
    return margins, scaled[np.arange(len(scaled)), tokens].astype(np.float64) - lse


def noise_at(seeds: list[int], positions: list[int], ids: list[int]) -> np.ndarray:
    """The noise of single entries: `ids[k]` at `positions[k]` of sample `seeds[k]`, exactly as the
    scans compute it (a device verifier's candidates get their noise here)."""
    out = np.empty(len(ids))
    _noise_at(row_keys(seeds, positions), np.asarray(ids, dtype=np.int64), out)
    return out

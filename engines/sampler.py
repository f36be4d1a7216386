"""Verifiable Gumbel-max at compiled speed, over a batch of rows: the node's sampler and the CPU
trainer's verifier (`protocols.sampling` is the definition; this computes exactly it).

The definition takes two logarithms per vocabulary entry (g = -log(-log u)); here they are taken
only where they can matter. With z = l / T + g and E = -log u, an entry beats a value z* only if
E_i < exp(l_i / T - z*), and E_i >= 1 - u_i, so an entry with 1 - u_i >= exp(l_i / T - z*) cannot
beat z*. The exp is the softmax's (the behaviour logprob needs it anyway), so per entry what is
left is the hash and a compare. z* starts at the z of the largest logit (and of the node's token)
and rises to the best z found as the scan goes, a block of entries at a time: the entries that
pass are those that could be a new best, a few dozen a row however flat the row is (a fixed z*
let ~e^-g / p_top entries of a flat row pass: all of them, at a random-token context). Each one
that passes gets its noise computed exactly, by the one compiled
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

# Entries filtered between tightenings of the bound: 16 at first, doubling to 1024 (multiples of 8:
# `_scan` reads 8 flags a word). A flat row's first block passes about half its entries (z* is then
# one entry's z), each later one about one: ~25 noise evaluations a row at a 152k vocabulary.
FIRST_BLOCK, LAST_BLOCK = 16, 1024
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
def _filter(key, exps, bound, keep, start, stop):
    """keep[i], start <= i < stop: entry i may beat the bound. With hi the top 32 bits of its hash
    and c = (2^32 - 1 - hi) >> 1, 1 - u_i > c * 2^-31; so c >= exps_i * bound (bound = 2^31 x
    exp(top / T - z*) x (1 + SLACK)) rules it out. A flag per entry vectorises (a list of the
    few kept ones would not), and apart from `_exps` (mixing float32 and uint64 lanes does not)."""
    x = key + np.uint64(start) * np.uint64(GOLDEN)
    e, k = exps[start:stop], keep[start:stop]  # (a loop from `start` over the whole arrays does not vectorise)
    for i in range(stop - start):
        x += np.uint64(GOLDEN)
        c = np.int32((np.uint64(0xFFFFFFFF) - (_mix(x) >> np.uint64(32))) >> np.uint64(1))
        k[i] = np.float32(c) < e[i] * bound


@numba.njit(inline="always")
def _bound(top, t, best_z):
    return np.float32(np.exp(np.float64(top) / t - best_z) * (1.0 + SLACK) * 2.0**31)


@numba.njit(cache=True)
def _scan(row, t, key, noisy, chosen, largest, exps, keep):
    """(argmax of z = row / t + g, its z, z at `chosen` (-1: none), log-sum-exp of row / t, entries
    whose noise was computed exactly) for one row; g = 0 unless `noisy` (greedy). `largest`: the
    row's argmax (numpy's: a max loop here does not vectorise, 7x slower). `exps`, `keep`: scratch
    of the row's length (`keep` padded to a multiple of 8)."""
    best = largest
    top = row[best]
    best_z = np.float64(top) / t + (_noise(key, best) if noisy else 0.0)
    chosen_z = 0.0
    if chosen >= 0:
        chosen_z = np.float64(row[chosen]) / t + (_noise(key, chosen) if noisy else 0.0)
        if chosen_z > best_z:
            best, best_z = chosen, chosen_z
    total = _exps(row, np.float32(1.0 / t), top, exps)
    lse = np.float64(top) / t + np.log(np.float64(total))
    exact = 0
    if noisy:
        n = row.shape[0]
        words = keep.view(np.uint64)  # 8 flags a word: the kept few are found 8 entries at a time
        bound = _bound(top, t, best_z)
        start, size = 0, FIRST_BLOCK
        while start < n:
            stop = min(start + size, n)
            _filter(key, exps, bound, keep, start, stop)
            for w in range(start // 8, (stop + 7) // 8):
                if words[w]:
                    for i in range(8 * w, min(8 * w + 8, stop)):
                        if keep[i]:
                            exact += 1
                            z = np.float64(row[i]) / t + _noise(key, i)
                            if z > best_z:
                                best, best_z = i, z
                                bound = _bound(top, t, best_z)
            start, size = stop, min(2 * size, LAST_BLOCK)
    return best, best_z, chosen_z, lse, exact


@numba.njit(parallel=True, cache=True)
def _scan_rows(rows, t, keys, noisy, chosen, largest, best, margins, lse, exact, threads):
    """`_scan` of every row, on numba's threads: best[r], margins[r] (best z - chosen z), lse[r],
    exact[r] (noise evaluations).
    Each thread takes every n-th row with scratch of its own, allocated once (fresh pages for
    every row cost as much as the scan)."""
    for first in numba.prange(threads):
        exps, keep = np.empty(rows.shape[1], np.float32), np.zeros(-(-rows.shape[1] // 8) * 8, np.bool_)
        for r in range(first, rows.shape[0], threads):
            best[r], best_z, chosen_z, lse[r], exact[r] = _scan(rows[r], t, keys[r], noisy[r], chosen[r], largest[r],
                                                                exps, keep)
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
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    _apply_threads()
    n = len(rows)
    noisy = np.array([s is not None for s in seeds], dtype=np.bool_)
    keys = row_keys([s or 0 for s in seeds], [int(p) for p in positions])
    best, margins, lse, exact = np.empty(n, np.int64), np.empty(n), np.empty(n), np.empty(n, np.int64)
    largest = rows.argmax(axis=1)
    _scan_rows(rows, float(temperature), keys, noisy, chosen, largest, best, margins, lse, exact,
               max(1, min(n, numba.get_num_threads())))
    return best, margins, lse, exact


def sample_rows(rows: np.ndarray, temperature: float, seeds: list[int | None], positions: list[int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, behaviour logprobs) of each row of float32 logits `rows` (R, V): Gumbel-max with
    sample `seeds[r]`'s noise at completion position `positions[r]` (seed None: greedy)."""
    tokens, _, lse, _ = _scan_all(rows, temperature, seeds, positions, np.full(len(rows), -1, np.int64))
    return tokens, rows[np.arange(len(rows)), tokens].astype(np.float64) / temperature - lse


def score_rows(scaled: np.ndarray, seeds: list[int | None], positions: np.ndarray, tokens: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(margins, logprobs) of node `tokens` under float32 logits / T `scaled` (N, V): how far each
    is from what these logits sample with the noise of `seeds[r]` at `positions[r]` (None: greedy,
    no noise), and its log-softmax."""
    tokens = np.asarray(tokens, dtype=np.int64)
    _, margins, lse, _ = _scan_all(scaled, 1.0, seeds, positions, tokens)
    return margins, scaled[np.arange(len(scaled)), tokens].astype(np.float64) - lse


def exact_evaluations(scaled: np.ndarray, seeds: list[int | None], positions: np.ndarray, tokens: np.ndarray
                      ) -> np.ndarray:
    """(N,) how many entries of each row `score_rows` computed the noise of exactly: its cost past
    the per-entry hash and exp, which the rows' flatness must not inflate (tests, benches)."""
    return _scan_all(scaled, 1.0, seeds, positions, np.asarray(tokens, dtype=np.int64))[3]


def noise_at(seeds: list[int], positions: list[int], ids: list[int]) -> np.ndarray:
    """The noise of single entries: `ids[k]` at `positions[k]` of sample `seeds[k]`, exactly as the
    scans compute it (a device verifier's candidates get their noise here)."""
    return noise_at_keys(row_keys(seeds, positions), ids)


def noise_at_keys(keys: np.ndarray, ids) -> np.ndarray:
    """`noise_at` of rows keyed `keys` (`protocols.sampling.row_keys`)."""
    out = np.empty(len(ids))
    _apply_threads()
    _noise_at(np.ascontiguousarray(keys, dtype=np.uint64), np.asarray(ids, dtype=np.int64), out)
    return out

"""The verifier's one pass over a batch's logits on a GPU (Triton): `engines.device_sampler` calls it.

One program per row reads the row's logits once and, in the same pass, keeps per lane the
running max and sum of exps (the log-sum-exp), the hash noise of every entry (SplitMix64 in
uint64 arithmetic, the definition's bits, and its two logarithms in float64), and the best and
second-best z = l + g with the best's index. A row leaves the device as five numbers: the argmax
of z, the logits at it and at the node's token, the gap to the runner-up, and the log-sum-exp.
The host then takes the exact noise of those two entries (`engines.sampler.noise_at`, the node's
own function), so margins are the node's bits; a gap under `device_sampler.TIE` sends the row to
the host's exact scan. The work per entry is fixed, whatever the logits are: no row costs more.

Runs under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors too: the tests do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # lanes a program scans at once


@triton.jit
def _mix(x):
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _scan_kernel(logits, stride, keys, noisy, tokens,
                 best_out, best_logit_out, chosen_logit_out, gap_out, lse_out, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = logits + r.to(tl.int64) * stride
    key = tl.load(keys + r).to(tl.uint64, bitcast=True)
    noise_on = tl.load(noisy + r) != 0
    lanes = tl.arange(0, BLOCK)
    peak = tl.full([BLOCK], -1e30, tl.float32)  # running max per lane, and the sum of exp(l - peak)
    total = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    second = tl.full([BLOCK], float("-inf"), tl.float64)
    best_at = tl.zeros([BLOCK], tl.int32)
    best_l = tl.zeros([BLOCK], tl.float32)
    for start in range(0, VOCAB, BLOCK):
        i = start + lanes
        inside = i < VOCAB
        l = tl.load(row + i, mask=inside, other=float("-inf"))
        higher = tl.maximum(peak, l)
        total = total * tl.exp(peak - higher) + tl.exp(l - higher)
        peak = higher
        bits = _mix(key + (i + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        u = ((bits >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53, as the definition
        g = -tl.log(-tl.log(u))
        z = tl.where(inside, l.to(tl.float64) + tl.where(noise_on, g, 0.0), float("-inf"))
        take = z > best
        second = tl.maximum(second, tl.where(take, best, z))
        best_at = tl.where(take, i, best_at)
        best_l = tl.where(take, l, best_l)
        best = tl.where(take, z, best)
    top = tl.max(best, axis=0)
    winners = best == top
    lane = tl.min(tl.where(winners, lanes, BLOCK), axis=0)  # the first lane holding the best
    own = lanes == lane
    runner_up = tl.max(tl.where(own, second, best), axis=0)
    peak_all = tl.max(peak, axis=0)
    lse = peak_all.to(tl.float64) + tl.log(tl.sum(total * tl.exp(peak - peak_all), axis=0).to(tl.float64))
    tl.store(best_out + r, tl.sum(tl.where(own, best_at, 0), axis=0))
    tl.store(best_logit_out + r, tl.sum(tl.where(own, best_l, 0.0), axis=0))
    tl.store(chosen_logit_out + r, tl.load(row + tl.load(tokens + r)))
    tl.store(gap_out + r, top - runner_up)
    tl.store(lse_out + r, lse)


def scan(scaled: torch.Tensor, keys: torch.Tensor, noisy: torch.Tensor, tokens: torch.Tensor,
         out: dict[str, torch.Tensor], rows: slice) -> None:
    """Queue the scan of `scaled` (n, V) float32 logits / T, rows `rows` of the batch whose
    per-row inputs (`keys` int64, `noisy` int32, `tokens` int64) and outputs (`out`: best int32,
    best_logit and chosen_logit float32, gap and lse float64) are whole-batch tensors on its device."""
    n, vocab = scaled.shape
    if n == 0:
        return
    scaled = scaled if scaled.stride(1) == 1 else scaled.contiguous()
    # The vocabulary is a compile-time constant: one model's, compiled once (and Triton's interpreter
    # cannot take a loop bound from a run-time argument under numpy 2.5).
    _scan_kernel[(n,)](scaled, scaled.stride(0), keys[rows], noisy[rows], tokens[rows],
                       out["best"][rows], out["best_logit"][rows], out["chosen_logit"][rows], out["gap"][rows],
                       out["lse"][rows], VOCAB=vocab, BLOCK=BLOCK, num_warps=4)

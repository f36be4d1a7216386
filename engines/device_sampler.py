"""Verification where the logits are: `engines.sampler.score_rows` on a torch device (a GPU
trainer's), with only a few numbers per row leaving it.

On the device: each entry's uniform (SplitMix64 in int64 arithmetic, which wraps like uint64, with
logical shifts masked by hand: bit for bit protocols.sampling's), the softmax, and the filter of
`engines.sampler` (an entry can beat z* only if 1 - u < exp(l - z*)). Back to the host: each row's
log-sum-exp, its node token's logit, and the few candidates (row, id, logit) that passed, whose
noise `engines.sampler.noise_at` computes exactly, as the node did. The bound z* only has to be
a lower bound of the row's best z, so here it may take torch's logarithms; the slack covers them.
"""

from __future__ import annotations

import numpy as np
import torch

from engines import sampler
from engines.sampler import SLACK, noise_at
from protocols.sampling import GOLDEN, row_keys

CHUNK_ENTRIES = 1 << 23  # rows x vocabulary per pass: 64 MiB of int64 bits


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _M2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(int(GOLDEN))


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift(x, 30)) * _M1
    x = (x ^ _shift(x, 27)) * _M2
    return x ^ _shift(x, 31)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, V) float64 u of every entry of rows keyed `keys` (int64 view of the uint64 keys)."""
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _GOLDEN
    return (_shift(_mix(keys[:, None] + ids[None, :]), 11).double() + 0.5) * 2.0**-53


def score_rows(scaled: torch.Tensor, seeds: list[int | None], positions: np.ndarray, tokens: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(margins, logprobs) of node `tokens` under float32 logits / T `scaled` (N, V), a torch tensor
    (`engines.sampler.score_rows`): on the CPU the compiled scan reads it in place; elsewhere
    `score_on_device`."""
    if scaled.device.type == "cpu":
        return sampler.score_rows(scaled.detach().numpy(), seeds, positions, tokens)
    return score_on_device(scaled, seeds, positions, tokens)


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

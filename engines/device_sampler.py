"""Verification where the logits are: `engines.sampler.score_rows` over a forward batch's logits on
a torch device, with a few numbers per row leaving it, once per batch.

`Scoring` takes a batch's rows a chunk of logits at a time (the vocabulary projection is made a
few rows at a time, so N x V floats never exist at once) and gives every row's margin and logprob
at the end:
- on the CPU, the compiled scan (`engines.sampler`) reads each chunk in place;
- on CUDA, one Triton kernel a chunk (`engines.triton_scan`) reads it once and leaves five
  numbers a row on the device; `result` copies them in one transfer, takes the exact noise of
  each row's argmax and node token on the host (the node's own function), and sends the rare row
  whose best two z are within `TIE` of each other to the exact scan, so margins are the node's
  bits whichever path ran;
- elsewhere (no Triton), the chunk comes to the host for the compiled scan.
Every path does a fixed amount of work per vocabulary entry: how flat a node makes the rows does
not change what verifying them costs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from engines import sampler
from protocols.sampling import row_keys

# z gap under which the device's float64 noise (a few ulps from the node's) might not name the
# argmax the node's noise does: such a row is scanned again exactly. Honest or hostile, a row's top
# two z are this close about once in 10^9 rows (the gap of two Gumbel maxima is ~Exp(1)).
TIE = 1e-9


def fused(device: torch.device) -> bool:
    """Whether rows on `device` are scanned by the Triton kernel (CUDA, or any tensor under Triton's
    interpreter, TRITON_INTERPRET=1, which tests use)."""
    if device.type != "cuda" and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Scoring:
    """The margins and logprobs of a batch's `tokens` (N,) under its logits / T, which `add` brings
    a chunk of rows at a time, in order; `seeds[r]` and `positions[r]` name row r's noise (seed
    None: greedy, no noise)."""

    def __init__(self, device: torch.device, seeds: list[int | None], positions: np.ndarray, tokens: np.ndarray):
        self.seeds, self.positions = seeds, np.asarray(positions)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        n = len(self.tokens)
        self.keys = row_keys([s or 0 for s in seeds], [int(p) for p in self.positions])
        self.noisy = np.array([s is not None for s in seeds], dtype=np.int32)
        self.done = 0  # rows added so far
        self.fused = fused(device)
        if self.fused:
            def up(a):
                return torch.from_numpy(a).to(device)
            self.inputs = dict(keys=up(self.keys.view(np.int64)), noisy=up(self.noisy), tokens=up(self.tokens))
            self.out = dict(best=torch.empty(n, dtype=torch.int32, device=device),
                            best_logit=torch.empty(n, dtype=torch.float32, device=device),
                            chosen_logit=torch.empty(n, dtype=torch.float32, device=device),
                            gap=torch.empty(n, dtype=torch.float64, device=device),
                            lse=torch.empty(n, dtype=torch.float64, device=device))
        else:
            self.margins, self.logprobs = np.empty(n), np.empty(n)

    def add(self, scaled: torch.Tensor) -> None:
        """The next rows' float32 logits / T (n, V)."""
        rows = slice(self.done, self.done + len(scaled))
        self.done = rows.stop
        if self.fused:
            from engines import triton_scan

            triton_scan.scan(scaled, self.inputs["keys"], self.inputs["noisy"], self.inputs["tokens"], self.out, rows)
            return
        host = scaled.detach().cpu().numpy()
        self.margins[rows], self.logprobs[rows] = sampler.score_rows(host, self.seeds[rows], self.positions[rows],
                                                                     self.tokens[rows])

    def result(self, logits_of: Callable[[np.ndarray], torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """(margins, logprobs) of every row added; `logits_of(rows)` makes the logits / T of rows
        again, for the rare near tie (the chunks are not kept: together they are N x V floats)."""
        assert self.done == len(self.tokens), f"{self.done} of {len(self.tokens)} rows scored"
        if not self.fused:
            return self.margins, self.logprobs
        packed = torch.cat([self.out["best"].double(), self.out["best_logit"].double(),
                            self.out["chosen_logit"].double(), self.out["gap"], self.out["lse"]]).cpu().numpy()
        best, best_logit, chosen_logit, gap, lse = packed.reshape(5, -1)
        best = best.astype(np.int64)
        noisy = self.noisy.astype(bool)
        g_best, g_chosen = np.zeros(len(best)), np.zeros(len(best))
        if noisy.any():
            g_best[noisy] = sampler.noise_at_keys(self.keys[noisy], best[noisy])
            g_chosen[noisy] = sampler.noise_at_keys(self.keys[noisy], self.tokens[noisy])
        margins = (best_logit + g_best) - (chosen_logit + g_chosen)
        margins[best == self.tokens] = 0.0
        # A greedy row's z is its logit, exact on the device: a tie there changes no margin.
        again = np.flatnonzero(noisy & ((gap < TIE) | (margins < 0)))
        if len(again):
            host = logits_of(again).detach().cpu().numpy()
            margins[again] = sampler.score_rows(host, [self.seeds[r] for r in again], self.positions[again],
                                                self.tokens[again])[0]
        return margins, chosen_logit - lse


def score_rows(scaled: torch.Tensor, seeds: list[int | None], positions: np.ndarray, tokens: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(margins, logprobs) of node `tokens` under float32 logits / T `scaled` (N, V) on any device
    (`engines.sampler.score_rows`): one `Scoring` of one chunk."""
    scoring = Scoring(scaled.device, seeds, positions, tokens)
    scoring.add(scaled)
    return scoring.result(lambda rows: scaled[torch.from_numpy(rows).to(scaled.device)])

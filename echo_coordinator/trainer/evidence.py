"""Verification's forward pass: the trainer's logits at a batch's model tokens, scored against the
nodes' tokens under the lease noise (`engines.device_sampler`: on a GPU one kernel pass over each
chunk of logits, and one transfer to the host a forward batch).

Each group's prompt runs once and its KV cache serves every completion (verification needs no
gradient, so a group's 8 samples cost one prompt, not eight), and several groups share one
forward (larger matmuls, fewer calls). The vocabulary projection and the scan take a few rows at
a time, so a 152k-vocabulary batch never holds N x V floats.

A mixture of experts adds one freedom an honest node has: a quantized node's router may send a
token whose k-th and (k+1)-th experts are nearly tied to the other one, and that token's logits
then move further than any dense model's rounding (docs/verification.md: 0.2-0.5 % of honest
tiny-MoE samples hold such a token, up to 4 past the trainer's choice, and 4 % a large logprob
error). So a sample that is an outlier or holds a large error is measured again alone, with the
trainer's routing flipped at one near tie of its worst token (`routing`), nearest first; a flip
under which it looks more honest is taken. A node that writes a token gains no more than that:
the choice of either routing at one near tie.
"""

from __future__ import annotations

import numpy as np
import torch

from echo_coordinator.trainer.routing import Routing, routers
from echo_coordinator.trainer.samples import TrainSample
from echo_coordinator.trainer.tensors import forward_batches, prompt_groups
from engines.device_sampler import Scoring, score_rows
from engines.hf import cache_field
from protocols.sampling import SampleEvidence, SamplingRule

VERIFY_ROWS = 256  # logits rows scored at once on the CPU: 50 MB at a 49k vocabulary, 156 MB at 152k
GPU_ENTRIES = 1 << 27  # on a GPU, rows x vocabulary at once (512 MB of float32): enough rows to fill it
NEAR_TIE = 0.8  # router logit gap a flip is tried under: 2x the largest behind an honest outlier (0.40)
MAX_FLIPS = 4  # near ties tried per re-checked sample


def measure(trainer, samples: list[TrainSample], seeds: list[int | None],
            rule: SamplingRule = SamplingRule()) -> list[SampleEvidence]:
    """Each sample's evidence under `trainer`'s current weights (`Trainer.evidence`)."""
    out: list[SampleEvidence | None] = [None] * len(samples)
    parts = prompt_groups(samples, trainer.config.micro_batch_tokens)
    lengths = [len(s.completion_ids) for s in samples]
    for batch in forward_batches(parts, lengths, trainer.config.micro_batch_tokens):
        indices = [i for part in batch for i in part]
        hidden, head = completion_hidden(trainer, [[samples[i] for i in part] for part in batch])
        positions = [np.flatnonzero(samples[i].loss_mask) for i in indices]
        row_seeds = [seeds[i] for i, p in zip(indices, positions) for _ in p]
        tokens = np.concatenate([np.asarray(samples[i].completion_ids)[p] for i, p in zip(indices, positions)])
        at = np.concatenate(positions)
        scoring = Scoring(trainer.device, row_seeds, at, tokens)  # on a GPU: one kernel a chunk, one sync
        chunk = VERIFY_ROWS if trainer.device.type == "cpu" else max(VERIFY_ROWS, GPU_ENTRIES // head.weight.shape[0])
        for a in range(0, len(tokens), chunk):
            scoring.add(scaled(trainer, head(hidden[a : a + chunk])))
        margins, logprobs = scoring.result(lambda rows: scaled(trainer, head(hidden[torch.from_numpy(rows)])))
        start = 0
        for i, p in zip(indices, positions):
            rows = slice(start, start + len(p))
            start += len(p)
            out[i] = SampleEvidence.of(margins[rows], logprobs[rows], np.asarray(samples[i].behaviour)[p])
    if routers(trainer.model):
        # A few samples a batch: honest ones hold at most one outlier (judge) and few large
        # errors, and a batch of written tokens must not buy many forwards.
        suspects = [i for i, e in enumerate(out) if rule.outlier(e) or e.large_errors]
        for i in sorted(suspects, key=lambda i: -out[i].max_margin)[: 2 + len(samples) // 8]:
            out[i] = rerouted(trainer, samples[i], seeds[i], out[i], rule)
    return out


def rerouted(trainer, sample: TrainSample, seed: int | None, found: SampleEvidence,
             rule: SamplingRule) -> SampleEvidence:
    """`sample`'s evidence under the first near-tie routing flip at its worst token (the largest
    margin past `max_margin`, else the largest logprob error) that leaves it no outlier or with
    fewer large logprob errors; `found` if none does."""
    at = np.flatnonzero(sample.loss_mask)
    tokens, behaviour = np.asarray(sample.completion_ids)[at], np.asarray(sample.behaviour)[at]
    rows = len(sample.prompt_ids) - 1 + at  # completion token j is predicted at the position before it
    with Routing(trainer.model) as routing:
        margins, logprobs = _score_alone(trainer, sample, seed, rows, at, tokens)
        errors = np.abs(logprobs - behaviour)
        worst = int(np.argmax(margins) if margins.max(initial=0.0) > rule.max_margin else np.argmax(errors))
        for flip in routing.near_ties([int(rows[worst])], NEAR_TIE)[:MAX_FLIPS]:
            routing.flip = flip
            evidence = SampleEvidence.of(*_score_alone(trainer, sample, seed, rows, at, tokens), behaviour)
            if (rule.outlier(evidence), evidence.large_errors) < (rule.outlier(found), found.large_errors):
                return evidence
    return found


def _score_alone(trainer, sample: TrainSample, seed: int | None, rows: np.ndarray, at: np.ndarray,
                 tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(margins, logprobs) of one sample's model tokens from a forward of it alone."""
    causal = trainer.causal
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids], device=trainer.device)
    hidden = causal.model(input_ids=ids).last_hidden_state[0, torch.from_numpy(rows).to(trainer.device)]
    return score_rows(scaled(trainer, causal.lm_head(hidden)), [seed] * len(at), at, tokens)


def completion_logits(trainer, part: list[TrainSample]) -> torch.Tensor:
    """(N, V) logits / T at the model tokens of samples that share one prompt (tests)."""
    hidden, head = completion_hidden(trainer, [part])
    return scaled(trainer, head(hidden))


def scaled(trainer, logits: torch.Tensor) -> torch.Tensor:
    """float32 logits / T, in place (no copy at T = 1)."""
    logits = logits.float()
    return logits if trainer.temperature == 1.0 else logits.div_(trainer.temperature)


def completion_hidden(trainer, parts: list[list[TrainSample]]) -> tuple[torch.Tensor, torch.nn.Module]:
    """((N, H) last hidden states at the model tokens of `parts`' samples, in order; the head that
    makes them logits). Each part's samples share a prompt. Prompts are left-padded, with a mask
    and explicit positions; completions are right-padded (real tokens never attend to later pads)."""
    causal = trainer.causal
    pad, device = trainer.tokenizer.pad_token_id or 0, trainer.device
    width = max(len(part[0].prompt_ids) for part in parts)
    prompts = torch.full((len(parts), width), pad, dtype=torch.long, device=device)
    prompt_mask = torch.zeros((len(parts), width), dtype=torch.long, device=device)
    for row, part in enumerate(parts):
        n = len(part[0].prompt_ids)
        prompts[row, width - n :] = torch.tensor(part[0].prompt_ids)
        prompt_mask[row, width - n :] = 1
    first = causal.model(input_ids=prompts, attention_mask=prompt_mask,
                         position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0), use_cache=True)
    owner = torch.tensor([row for row, part in enumerate(parts) for _ in part], device=device)
    named = cache_field(causal.model)
    cache = getattr(first, named)
    cache.reorder_cache(owner)  # each sample's rows of the cache: its prompt's
    samples = [s for part in parts for s in part]
    length = max(len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), length), pad, dtype=torch.long, device=device)
    where = torch.zeros((len(samples), length), dtype=torch.bool, device=device)
    for row, s in enumerate(samples):
        ids[row, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        where[row, : len(s.completion_ids)] = torch.tensor(s.loss_mask, dtype=torch.bool)
    mask = torch.cat([prompt_mask[owner], torch.ones_like(ids)], dim=1)
    positions = prompt_mask.sum(1)[owner][:, None] + torch.arange(length, device=device)[None, :]
    after = causal.model(input_ids=ids, attention_mask=mask, position_ids=positions, **{named: cache}).last_hidden_state
    # Completion token j is predicted at the position before it: the prompt's last for j = 0.
    hidden = torch.cat([first.last_hidden_state[owner, -1:], after[:, :-1]], dim=1)  # (N, C, H)
    return hidden[where], causal.lm_head

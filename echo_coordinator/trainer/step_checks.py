"""Verification for free: batches judged from the training step's own forward (issue 34, point 4).

Where the weights a batch was sampled with are the weights at the start of the step (LoRA at
staleness 0: nodes hold the trainer's base and the version's adapter, which the step's forwards
run under: `Trainer.step`'s `held`), the logits a step computes for its loss are the logits a
separate verification forward would compute. So the step scores its checked samples from them
before their backward, judges each batch once its samples are all scored, and drops a refused
batch's samples from the loss. A batch is judged as one pool (the rule has per-batch parts), so
its trained samples share one micro-batch (`units`); its samples that the step does not train
(advantage 0, or a batch too long for one micro-batch) are scored first by a separate forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from protocols.sampling import SampleEvidence, SamplingRule, judge


@dataclass(frozen=True)
class Check:
    """One batch the step judges: its samples' places in the step's batch, and their lease noise."""

    samples: tuple[int, ...]
    seeds: tuple[int | None, ...]


@dataclass(frozen=True)
class Verdict:
    """What a step found of one `Check`: None, or the judge's reason code; and the evidence."""

    reason: str | None
    evidence: tuple[SampleEvidence, ...]
    free: int  # samples scored from the step's own forward (the rest: a forward of their own)


class StepChecks:
    """The checks of one step: evidence as it comes, and a verdict per check once it is whole."""

    def __init__(self, checks: list[Check], rule: SamplingRule):
        self.checks, self.rule = checks, rule
        self.owner = {i: (c, seed) for c, check in enumerate(checks) for i, seed in zip(check.samples, check.seeds)}
        self.found: list[dict[int, SampleEvidence]] = [{} for _ in checks]
        self.free = [0] * len(checks)
        self.verdicts: list[Verdict | None] = [None] * len(checks)
        self.dropped: set[int] = set()  # the samples of the checks refused so far
        self.seconds = 0.0  # scoring and judging time, and the separate forwards'

    def scored_apart(self, trainer, samples: list, which: list[int], held: dict[str, np.ndarray] | None) -> StepChecks:
        """Score now, by a forward of their own (`trainer.evidence`), the samples the step's
        forwards will not (not trained: `which` are; or a batch more than one micro-batch holds),
        and judge the batches that makes whole. With more than one optimiser step a batch (the
        weights move between forwards) every checked sample is scored so. Returns self."""
        config, trained = trainer.config, set(which)
        apart = [i for i in self.owner if i not in trained]
        if config.ppo_epochs * config.ppo_minibatches > 1:
            apart = list(self.owner)
        else:
            lengths = {i: len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in which}
            apart += self.units(which, lengths, config.micro_batch_tokens)[1]
        if apart:
            started = time.perf_counter()
            for i, e in zip(apart, trainer.evidence([samples[i] for i in apart], self.seeds(apart), held)):
                self.add(i, e, free=False)
            self.seconds += time.perf_counter() - started
            self.refused()
        return self

    def units(self, indices: list[int], lengths: dict[int, int], max_tokens: int) -> tuple[list[list[int]], list[int]]:
        """(`indices` (samples the step trains) as packing units: each check's together, the others
        alone; the checked samples a micro-batch cannot hold together, to be scored apart)."""
        by_check: dict[int, list[int]] = {}
        units = []
        for i in indices:
            if i in self.owner:
                by_check.setdefault(self.owner[i][0], []).append(i)
            else:
                units.append([i])
        apart = []
        for unit in by_check.values():
            if len(unit) * max(lengths[i] for i in unit) <= max_tokens or len(unit) == 1:
                units.append(unit)
            else:  # trained alone, scored apart
                units += [[i] for i in unit]
                apart += unit
        return units, apart

    def packing(self, where: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
        """`micro_batches`' units for a step's part (`where`: its samples' places in the batch;
        `lengths`: theirs), as places in the part."""
        place = {i: k for k, i in enumerate(where)}
        return [[place[i] for i in unit] for unit in self.units(where, dict(zip(where, lengths)), max_tokens)[0]]

    def judge_micro_batch(self, indices: list[int], samples: list, scaled, mask) -> int:
        """Score a micro-batch's checked samples (`score`), judge the batches that makes whole, and
        take a refused one's rows out of `mask` (its (B, L-1) loss mask); the tokens taken out."""
        self.score(indices, samples, scaled)
        refused, dropped = self.refused(), 0
        for row, i in enumerate(indices):
            if i in refused:  # its logits stay in the graph, masked out of the loss
                dropped += int(mask[row].sum())
                mask[row] = 0.0
        return dropped

    def seeds(self, indices: list[int]) -> list[int | None]:
        return [self.owner[i][1] for i in indices]

    def add(self, i: int, evidence: SampleEvidence, free: bool) -> None:
        c = self.owner[i][0]
        self.found[c][i] = evidence
        self.free[c] += free

    def score(self, indices: list[int], samples: list, scaled) -> None:
        """Score the checked ones of a micro-batch's samples (`indices`, in its row order) from its
        (N, V) logits / T at their model tokens, row by row (the rows `Trainer._scaled_logits` gives)."""
        import torch  # (the step loop imports this module for `Check`; torch only where a trainer runs)

        from engines.device_sampler import Scoring

        started = time.perf_counter()
        counts = [int(sum(samples[i].loss_mask)) for i in indices]
        starts = np.cumsum([0] + counts)
        mine = [(i, a) for i, a in zip(indices, starts[:-1]) if i in self.owner and i not in self.found[self.owner[i][0]]]
        if mine:
            positions = [np.flatnonzero(samples[i].loss_mask) for i, _ in mine]
            rows = torch.from_numpy(np.concatenate([a + np.arange(len(p)) for (_, a), p in zip(mine, positions)]))
            # (every row checked, the common case: the logits themselves, no N x V copy)
            logits = scaled.detach() if len(rows) == len(scaled) else scaled.detach()[rows.to(scaled.device)]
            scoring = Scoring(scaled.device, [self.owner[i][1] for (i, _), p in zip(mine, positions) for _ in p],
                              np.concatenate(positions),
                              np.concatenate([np.asarray(samples[i].completion_ids)[p] for (i, _), p in zip(mine, positions)]))
            scoring.add(logits)
            margins, logprobs = scoring.result(lambda r: logits[torch.from_numpy(r).to(logits.device)])
            start = 0
            for (i, _), p in zip(mine, positions):
                span = slice(start, start + len(p))
                start += len(p)
                self.add(i, SampleEvidence.of(margins[span], logprobs[span], np.asarray(samples[i].behaviour)[p]), True)
        self.seconds += time.perf_counter() - started

    def refused(self) -> set[int]:
        """Judge every check whose samples are all scored and not yet judged; the samples of
        those refused now (to leave out of the loss)."""
        out = set()
        for c, check in enumerate(self.checks):
            if self.verdicts[c] is None and len(self.found[c]) == len(check.samples):
                evidence = tuple(self.found[c][i] for i in check.samples)
                self.verdicts[c] = Verdict(judge(list(evidence), self.rule), evidence, self.free[c])
                if self.verdicts[c].reason is not None:
                    out.update(check.samples)
        self.dropped |= out
        return out

"""Rollout verification on the trainer: was each sample sampled, or written? (protocols.sampling)

The trainer keeps what nodes hold at each version the staleness bound still admits (the LoRA
adapter, or in full mode the publisher's view as nodes load it, requantized: `NodesHold`; not
the trainer's own weights), re-derives every sample's Gumbel noise from its lease, and runs its
own forward pass under that version's weights. The batch, pooled, is judged by
`protocols.sampling.judge`; which batches are checked at all is `trust.SpotCheck`'s decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from echo_coordinator.trainer.samples import TrainSample
from protocols.errors import VerificationError
from protocols.messages import RolloutSample
from protocols.sampling import SampleEvidence, SamplingRule, judge, sample_seeds

# (samples, their sample seeds (None: greedy), node-held weights of the version) -> evidence per sample
Evidence = Callable[[list[TrainSample], list[int | None], dict[str, np.ndarray]], list[SampleEvidence]]


def lora_base(adapter: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Version 0 of a LoRA run as an adapter: nodes run the bare base model, which is any adapter
    whose B matrices are zero (its output B·A·x is exactly 0)."""
    return {k: np.zeros_like(v) if "lora_B" in k else v for k, v in adapter.items()}


class NodesHold:
    """Full mode: what nodes hold, given the publisher's view. Nodes apply the trainer's changes
    to their own master weights: when their base is the trainer's (a GGUF run) the master weights
    are the view itself; from an HF checkpoint their base is its quantization (`node_base`,
    dequantized), so they are node_base + (view - trainer_base). A node samples with its master
    weights as it loads them: requantized to its base file's type (`requantize`:
    `engines.full_weights.requantized`, which returns new arrays; the view changes in place)."""

    def __init__(self, requantize: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                 trainer_base: dict[str, np.ndarray] | None = None, node_base: dict[str, np.ndarray] | None = None):
        self.requantize, self.trainer_base, self.node_base = requantize, trainer_base, node_base

    def master(self, view: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The nodes' master weights (the view itself in a GGUF run, not a copy)."""
        if self.node_base is None:
            return view
        return {k: self.node_base[k] + (v - self.trainer_base[k]) for k, v in view.items()}

    def __call__(self, view: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.requantize(self.master(view))


class Verifier:
    """`run(fn, behind)` runs `fn()` where the trainer's forward passes may run (the coordinator: its
    one torch thread; `behind`: after the other work waiting there) and returns its result; by
    default, here."""

    def __init__(self, evidence: Evidence, rule: SamplingRule, keep_versions: int,
                 run: Callable[..., object] = lambda fn, behind=False: fn()):
        self.evidence, self.rule, self.keep_versions, self.run = evidence, rule, keep_versions, run
        self.held: dict[int, dict[str, np.ndarray]] = {}  # version -> what nodes hold at it
        self.checked_samples = 0  # for metrics: samples verified so far
        self.free_samples = 0  # of them, scored from a training step's own forward (`trainer.step_checks`)
        # and the trainer time it took (forward passes, noise, margins), not the wait for the
        # trainer's thread, which a training step may hold for a while
        self.seconds = 0.0

    def remember(self, version: int, weights: dict[str, np.ndarray]) -> None:
        """Nodes hold `weights` at `version`; versions the bound no longer admits are forgotten."""
        held = {**self.held, version: weights}  # copy and swap: handler threads read `held`
        self.held = {v: w for v, w in held.items() if v >= version - self.keep_versions}

    def check(self, lease_id: str, version: int, samples: Sequence[RolloutSample],
              weights: dict[str, np.ndarray] | None = None, greedy: bool = False, behind: bool = False,
              ) -> list[SampleEvidence]:
        """Raise VerificationError (naming the worst sample) unless the batch is what sampling with
        `version`'s weights and the lease's noise gives, up to quantization; return the evidence.
        An evaluation batch brings its round's `weights` and may be `greedy` (no noise). `behind`:
        the forward waits for the trainer's other work (a new key's batch)."""
        train = [TrainSample.of(s) for s in samples]
        seeds = [None] * len(samples) if greedy else sample_seeds(lease_id, [s.seed for s in samples])
        reason, found = self.judged(version, train, seeds, weights, behind)
        if reason is not None:
            worst = max(range(len(found)), key=lambda i: (found[i].max_margin, found[i].mean_logprob_error))
            e = found[worst]
            raise VerificationError(reason, (
                f"batch is not what version {version} samples with this lease's noise ({reason}): "
                f"{sum(x.flips for x in found)}/{sum(x.tokens for x in found)} tokens differ from the trainer's choice; "
                f"worst sample {worst} (seed {samples[worst].seed}): max margin {e.max_margin:.2f}, "
                f"logprob error max {e.max_logprob_error:.3f} mean {e.mean_logprob_error:.3f}"))
        return found

    def judged(self, version: int, samples: list[TrainSample], seeds: list[int | None],
               weights: dict[str, np.ndarray] | None = None, behind: bool = False,
               ) -> tuple[str | None, list[SampleEvidence]]:
        """(`judge`'s reason or None, the evidence) for a batch's samples and their noise `seeds`;
        VerificationError `unverifiable` when no weights of `version` are held."""
        weights = self.held.get(version) if weights is None else weights
        if weights is None:
            # Only after a restart (older versions died with the process) or for a version the
            # bound no longer admits; either way nothing here can vouch for the batch.
            raise VerificationError("unverifiable", f"no weights of version {version} to check against")

        def timed() -> tuple[list[SampleEvidence], float]:
            started = time.perf_counter()
            return self.evidence(samples, seeds, weights), time.perf_counter() - started

        found, seconds = self.run(timed, behind)
        self.counted(len(found), seconds)
        return judge(found, self.rule), found

    def counted(self, samples: int, seconds: float, free: int = 0) -> None:
        """`samples` verified in `seconds` of trainer time, `free` of them from a step's own forward."""
        self.seconds += seconds
        self.checked_samples += samples
        self.free_samples += free

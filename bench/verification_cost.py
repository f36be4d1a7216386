"""What verification costs beside a training step, before and after the fused pass (issue 34),
side by side in one run.

Parts, each the median of `--rounds`:
1. **scan**: the scorer alone on 152k-vocabulary rows (float32 logits), peaked (an honest node's
   context) and flat (a random-token context a hostile node drives the rows to): ms per row
   before (`verification_before`: the fixed filter bound) and after (the bound rising with the best
   z), with the exact noise evaluations per row.
2. **CPU models**: `Trainer.evidence` at full checking against `Trainer.step` on the same batch
   (8 prompts x 8 samples x up to 32 tokens, LoRA): the demo model (SmolLM2-135M, 49k vocabulary)
   and a small random Qwen2-shaped model with Qwen's 151,936-entry vocabulary. Honest batch: the
   trainer's own samples under the lease noise (every one accepted); hostile: random tokens. And
   where verification is free (point 4: LoRA, staleness 0), the step verifying the batch itself
   (4 leases) from its own forward: the scoring time inside it, and its time against the plain step.
3. **holding** (full mode): what verifying a lease against another version costs besides the
   forward: before, the trainer's weights to the host, the version in, the trainer's back in; after,
   the parameters' storage swapped for the version kept on the device.
4. **GPU** (when torch sees one): Qwen2-0.5B-shaped (8 x 1,024 tokens) and Qwen3-4B-shaped (16 x
   1,024) random models in full mode (bf16 compute over fp32 master weights): the step, and
   evidence on a flat batch (the random model as it is, random tokens) and a peaked one (its final
   norm scaled up); before on `--before-samples` samples only, scaled to the batch by its tokens.
Before and after are timed in turn, a round at a time, so that the machine's drift falls on both.

    .venv/bin/python bench/verification_cost.py [--rounds 3] [--parts scan cpu holding gpu]
        [--gpu-shapes 0.5b 4b] [--tokenizer DIR]   # DIR: HF tokenizer files (a GPU machine without the demo model)

Ends with one JSON line: `verify_over_step_cpu_152k`, `hostile_over_honest_cpu`, ... and the GPU
figures when a GPU ran it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import verification_before as before  # noqa: E402

from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.trainer import evidence as evidence_module  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402
from echo_coordinator.trainer.step_checks import Check  # noqa: E402
from engines import sampler  # noqa: E402
from engines.hf import cache_field  # noqa: E402
from protocols.sampling import sample_seeds  # noqa: E402

VOCAB = 151_936
GPU_SHAPES = {  # (config class, shape, samples, tokens each)
    "0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2), 8, 1024),
    "4b": ("Qwen3Config", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128), 16, 1024),
    "tiny": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16), 2, 64),  # checks the part on the CPU
}
CPU_152K = ("Qwen2Config", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2))


def median_of(fn, rounds: int, sync=lambda: None) -> float:
    out = []
    for _ in range(rounds):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - started)
    return statistics.median(out)


def tokenizer_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    from tests.support.tiny_model import _smollm2_tokenizer_dir

    return _smollm2_tokenizer_dir()


def random_checkpoint(directory: Path, config_class: str, shape: dict, tokenizer: Path, device: str,
                      dtype=torch.float32) -> Path:
    """A random model of `shape` with Qwen's vocabulary, saved with the SmolLM2 tokenizer (its ids
    are below every vocabulary here)."""
    import transformers

    config = getattr(transformers, config_class)(**shape, vocab_size=VOCAB, max_position_embeddings=4096,
                                                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(directory)
    del model
    for f in tokenizer.iterdir():
        shutil.copy(f, directory / f.name)
    return directory


# -------------------------------------------------------------------------------------------- scan

def scan_part(rounds: int) -> dict:
    rng = np.random.default_rng(0)
    n = 256
    peaked = (rng.standard_normal((n, VOCAB)) * 3.0).astype(np.float32)
    peaked[np.arange(n), rng.integers(0, VOCAB, n)] += 14.0
    flat = (rng.standard_normal((n, VOCAB)) * 1e-3).astype(np.float32)
    seeds = [int(s) for s in rng.integers(0, 2**63, n)]
    positions, tokens = np.arange(n), rng.integers(0, VOCAB, n)
    out = {}
    for name, rows in (("peaked", peaked), ("flat", flat)):
        for path, fn in (("before", before.score_rows), ("after", sampler.score_rows)):
            fn(rows[:8], seeds[:8], positions[:8], tokens[:8])  # compiled
            out[f"{name}_{path}_ms_per_row"] = 1e3 * median_of(lambda: fn(rows, seeds, positions, tokens), rounds) / n
        out[f"{name}_exact_per_row"] = float(np.mean(sampler.exact_evaluations(rows, seeds, positions, tokens)))
        assert np.array_equal(before.score_rows(rows, seeds, positions, tokens)[0],
                              sampler.score_rows(rows, seeds, positions, tokens)[0])  # the same margins
    print("\n1. the scan alone, 152k vocabulary, ms per row (2 cores)")
    print("| rows | before | after | after / before | exact noise a row (after) |\n|---|---|---|---|---|")
    for name in ("peaked", "flat"):
        b, a = out[f"{name}_before_ms_per_row"], out[f"{name}_after_ms_per_row"]
        print(f"| {name} | {b:.3f} | {a:.3f} | {a / b:.3f} | {out[name + '_exact_per_row']:.1f} |")
    out["flat_over_peaked_after"] = out["flat_after_ms_per_row"] / out["peaked_after_ms_per_row"]
    out["flat_over_peaked_before"] = out["flat_before_ms_per_row"] / out["peaked_before_ms_per_row"]
    return out


# ------------------------------------------------------------------------------- batches, evidence

def own_samples(trainer: Trainer, prompts: list[tuple[int, ...]], group: int, length: int, lease: str
                ) -> tuple[list[TrainSample], list[int]]:
    """Each prompt's `group` completions sampled by the trainer itself under the lease noise (as an
    honest fp32 node samples them), with its behaviour logprobs."""
    samples, seeds = [], []
    for p, prompt in enumerate(prompts):
        noise = sample_seeds(lease, [p] * group)
        ids = torch.tensor([list(prompt)] * group, device=trainer.device)
        out = [[] for _ in range(group)]
        with torch.no_grad(), trainer.autocast():
            cache, step, named = None, ids, cache_field(trainer.causal)
            for position in range(length):
                result = trainer.causal(input_ids=step, use_cache=True, **{named: cache})
                cache = getattr(result, named)
                rows = (result.logits[:, -1].float() / trainer.temperature).cpu().numpy()
                tokens, logprobs = sampler.sample_rows(rows, 1.0, noise, [position] * group)
                for g in range(group):
                    out[g].append((int(tokens[g]), float(logprobs[g])))
                step = torch.tensor(tokens[:, None], device=trainer.device)
        for g in range(group):
            samples.append(TrainSample(tuple(prompt), tuple(t for t, _ in out[g]), tuple(lp for _, lp in out[g]),
                                       (1,) * length, float(g % 2), p))
            seeds.append(noise[g])
    return samples, seeds


def hostile(samples: list[TrainSample], seed: int = 1) -> list[TrainSample]:
    """The same prompts and lengths, completions of random tokens: a context that flattens the rows."""
    rng = np.random.default_rng(seed)
    return [TrainSample(s.prompt_ids, tuple(int(t) for t in rng.integers(100, 40_000, len(s.completion_ids))),
                        (-10.0,) * len(s.completion_ids), s.loss_mask, s.reward, s.group) for s in samples]


def evidence_with(trainer: Trainer, samples, seeds, weights, old: bool) -> float:
    """Seconds of one `Trainer.evidence`, with the new scoring or the old (`old`)."""
    saved = evidence_module.Scoring
    evidence_module.Scoring = before.Scoring if old else saved
    try:
        started = time.perf_counter()
        trainer.evidence(samples, seeds, weights)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started
    finally:
        evidence_module.Scoring = saved


def interleaved(calls: dict, rounds: int) -> dict:
    """Each of `calls` (name -> fn returning seconds) once a round, in turn, after one warm-up
    call each (compiled code, the version onto the device): the medians. In turn, so that a
    machine's drift over the run falls on every figure alike."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def model_part(name: str, source: Path, prompts: list[tuple[int, ...]], rounds: int) -> dict:
    trainer = Trainer(source, TrainerConfig(threads=0), 1.0, update="lora")
    samples, seeds = own_samples(trainer, prompts, 8, 32, lease=f"bench-{name}")
    bad = hostile(samples)
    weights = {k: v.copy() for k, v in trainer.weights().items()}  # a held version: the same adapter, another dict
    verdict = [e.max_margin for e in trainer.evidence(samples, seeds, weights)]

    # Where point 4 applies (LoRA, staleness 0): the batch as 4 leases of 2 prompts, verified by the step.
    checks = [Check(tuple(range(a, a + 16)), tuple(seeds[a : a + 16])) for a in range(0, len(samples), 16)]
    scoring: list[float] = []

    def step(checked: bool = False) -> float:
        started = time.perf_counter()
        stats = trainer.step(samples, checks=checks, held=weights) if checked else trainer.step(samples)
        if checked:
            assert all(v.reason is None and v.free == 16 for v in stats.verdicts), stats.verdicts
            scoring.append(stats.check_seconds)
        return time.perf_counter() - started

    calls = {f"{kind}_{path}_s": (lambda batch=batch, old=path == "before": evidence_with(trainer, batch, seeds, weights, old))
             for kind, batch in (("honest", samples), ("hostile", bad)) for path in ("before", "after")}
    out = interleaved({**calls, "step_s": step, "step_checked_s": lambda: step(True)}, rounds)
    out["in_step_s"] = statistics.median(scoring[1:])  # (after the warm-up call)
    out["honest_max_margin"] = max(verdict)
    print(f"\n2. {name}: evidence at full checking and a LoRA step, 64 samples x 32 tokens (median of {rounds})")
    print("| batch | evidence before (s) | after (s) | after / before | after / step |\n|---|---|---|---|---|")
    for kind in ("honest", "hostile"):
        b, a = out[f"{kind}_before_s"], out[f"{kind}_after_s"]
        print(f"| {kind} | {b:.3f} | {a:.3f} | {a / b:.3f} | {a / out['step_s']:.3f} |")
    print(f"| step | {out['step_s']:.3f} s | | | |")
    print(f"| in the step (point 4) | | {out['in_step_s']:.3f} | | {out['in_step_s'] / out['step_s']:.3f} |")
    print(f"| step verifying its batch | {out['step_checked_s']:.3f} s | | | "
          f"{out['step_checked_s'] / out['step_s']:.3f} x the step |")
    out["verify_over_step"] = out["honest_after_s"] / out["step_s"]
    out["in_step_over_step"] = out["in_step_s"] / out["step_s"]
    out["hostile_over_honest"] = out["hostile_after_s"] / out["honest_after_s"]
    out["hostile_over_honest_before"] = out["hostile_before_s"] / out["honest_before_s"]
    return out

def prompts_of(tokenizer, count: int) -> list[tuple[int, ...]]:
    from engines.hf import prompt_ids
    from tasks import make_task

    task = make_task("arithmetic", {"digits": 1})
    return [prompt_ids(tokenizer, task.generate(s).messages) for s in range(count)]


def holding_part(source: Path, rounds: int) -> dict:
    """Full mode: entering and leaving another version, before (copies) and after (swap)."""
    trainer = Trainer(source, TrainerConfig(threads=0), 1.0, update="full")
    held = {k: v * 1.0 for k, v in trainer.weights().items()}

    def old() -> None:  # TrainerWeights.holding before issue 34
        own = trainer.weights()
        trainer.load_weights(held)
        trainer.load_weights(own)

    def new() -> None:
        with trainer.holding(held):
            pass

    new()  # the version onto the device, once
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    out = dict(before_s=median_of(old, rounds, sync), after_s=median_of(new, rounds, sync),
               held_bytes=sum(t.numel() * t.element_size() for t in trainer._held[1].values()))
    print(f"\n3. holding another version (full mode, {source.name}, {trainer.device.type}): before {out['before_s']:.3f} s, "
          f"after {out['after_s'] * 1e3:.2f} ms a lease; the version kept on the device: {out['held_bytes'] / 2**20:.0f} MiB")
    return out


# -------------------------------------------------------------------------------------------- GPU

def gpu_part(shape_name: str, tokenizer: Path, rounds: int, before_samples: int) -> dict:
    config_class, shape, n, length = GPU_SHAPES[shape_name]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory(prefix=f"echo-verify-{shape_name}-") as tmp:
        source = random_checkpoint(Path(tmp), config_class, shape, tokenizer, device, torch.bfloat16)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(source, TrainerConfig(learning_rate=1e-6, micro_batch_tokens=4096, device=device), 1.0,
                          update="full")
    g = torch.Generator().manual_seed(0)
    prompt = 16
    samples = []
    for i in range(n):
        ids = torch.randint(100, 40_000, (length,), generator=g).tolist()
        samples.append(TrainSample(tuple(ids[:prompt]), tuple(ids[prompt:]), (-11.0,) * (length - prompt),
                                   (1,) * (length - prompt), float(i % 2), i // 4))
    seeds = sample_seeds("bench-gpu", [s.group * 1000 + i for i, s in enumerate(samples)])
    held = {k: v.copy() for k, v in trainer.weights().items()}
    out = dict(step_s=median_of(lambda: trainer.step(samples), rounds, sync))
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    norm = trainer.causal.model.norm.weight
    part = max(1, before_samples)
    for kind, scale in (("flat", 1.0), ("peaked", 30.0)):
        with torch.no_grad():
            norm.mul_(scale)
        found = interleaved(dict(
            after=lambda: evidence_with(trainer, samples, seeds, held, False),
            before=lambda: evidence_with(trainer, samples[:part], seeds[:part], held, True) * n / part), rounds)
        out[f"{kind}_after_s"] = found["after"]
        out[f"{kind}_before_s"] = found["before"]  # scaled by tokens: the old path's cost is per row
        with torch.no_grad():
            norm.div_(scale)
    out["verify_over_step"] = out["peaked_after_s"] / out["step_s"]
    out["hostile_over_honest"] = out["flat_after_s"] / out["peaked_after_s"]
    print(f"\n4. {device} {shape_name} ({n} x {length} tokens, full mode, fp32 master weights): step {out['step_s']:.3f} s, "
          f"peak {out['peak_gib']:.1f} GiB")
    print("| rows | evidence before (s) | after (s) | after / step |\n|---|---|---|---|")
    for kind in ("peaked", "flat"):
        print(f"| {kind} | {out[kind + '_before_s']:.2f} | {out[kind + '_after_s']:.3f} | "
              f"{out[kind + '_after_s'] / out['step_s']:.3f} |")
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["scan", "cpu", "holding", "gpu"])
    parser.add_argument("--gpu-shapes", nargs="+", default=["0.5b", "4b"])
    parser.add_argument("--before-samples", type=int, default=1, help="GPU: samples the old path is timed on")
    parser.add_argument("--tokenizer", help="a directory of HF tokenizer files (default: the demo model's)")
    args = parser.parse_args()
    result: dict = {}
    tokenizer = tokenizer_dir(args.tokenizer)
    if "scan" in args.parts:
        result["scan"] = scan_part(args.rounds)
    if "cpu" in args.parts or "holding" in args.parts:
        from echo_coordinator.main import demo_model_path
        from engines.hf import load_tokenizer

        demo = demo_model_path()
        prompts = prompts_of(load_tokenizer(demo), 8)
        with tempfile.TemporaryDirectory(prefix="echo-verify-152k-") as tmp:
            big = random_checkpoint(Path(tmp), *CPU_152K, tokenizer, "cpu")
            if "cpu" in args.parts:
                result["demo"] = model_part("demo model (SmolLM2-135M Q4_1, 49k vocabulary)", demo, prompts, args.rounds)
                result["cpu_152k"] = model_part("random Qwen2-shaped model, 152k vocabulary", big, prompts, args.rounds)
            if "holding" in args.parts:
                result["holding_demo"] = holding_part(demo, args.rounds)
    if "gpu" in args.parts and (torch.cuda.is_available() or args.gpu_shapes == ["tiny"]):
        for shape in args.gpu_shapes:
            result[f"gpu_{shape}"] = gpu_part(shape, tokenizer, args.rounds, args.before_samples)
    summary = {}
    if "cpu_152k" in result:
        summary.update(verify_over_step_cpu_152k=round(result["cpu_152k"]["verify_over_step"], 3),
                       hostile_over_honest_cpu=round(result["cpu_152k"]["hostile_over_honest"], 3),
                       verify_over_step_cpu_demo=round(result["demo"]["verify_over_step"], 3),
                       hostile_over_honest_cpu_demo=round(result["demo"]["hostile_over_honest"], 3),
                       in_step_over_step_cpu_152k=round(result["cpu_152k"]["in_step_over_step"], 3),
                       in_step_over_step_cpu_demo=round(result["demo"]["in_step_over_step"], 3),
                       checked_step_over_step_cpu_152k=round(result["cpu_152k"]["step_checked_s"] / result["cpu_152k"]["step_s"], 3))
    if "scan" in result:
        summary.update(scan_flat_over_peaked=round(result["scan"]["flat_over_peaked_after"], 3),
                       scan_flat_over_peaked_before=round(result["scan"]["flat_over_peaked_before"], 3))
    if "holding_demo" in result:
        summary.update(holding_after_over_before=round(result["holding_demo"]["after_s"] / result["holding_demo"]["before_s"], 5))
    for shape in args.gpu_shapes:
        if f"gpu_{shape}" in result:
            r = result[f"gpu_{shape}"]
            summary[f"verify_over_step_gpu_{shape}"] = round(r["verify_over_step"], 3)
            summary[f"hostile_over_honest_gpu_{shape}"] = round(r["hostile_over_honest"], 3)
            summary[f"before_over_step_gpu_{shape}"] = round(r["flat_before_s"] / r["step_s"], 1)
    summary.update(rounds=args.rounds, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   detail=result)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

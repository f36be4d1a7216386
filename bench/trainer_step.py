"""The trainer's GRPO step against a plain loop on the same batch, side by side in one run.

The batch is the demo's: SmolLM2-135M-Instruct (the shipped Q4_1 file, dequantized to fp32 as
the trainer loads it), LoRA r=16, 8 prompts of the demo task x 8 completions of 32 tokens.
The plain loop is what one would write by hand: one padded forward of the whole batch through
peft, full-vocabulary log-softmax, -A * logprob averaged over completion tokens, backward, AdamW.

    .venv/bin/python bench/trainer_step.py [--repeats 3] [--threads 0]

Also times verifying the same batch (`Trainer.evidence`, what a spot check costs). Prints the
median seconds of each and a final JSON line with `step_over_plain` (lower is better; 1.0 = as
fast as the plain loop) and `verify_over_step`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.main import demo_model_path  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402
from engines.hf import prompt_ids  # noqa: E402
from tasks import make_task  # noqa: E402


def demo_batch(trainer: Trainer, prompts: int = 8, group: int = 8, tokens: int = 32) -> list[TrainSample]:
    task, rng = make_task("arithmetic", {"digits": 1}), np.random.default_rng(0)
    samples = []
    for seed in range(prompts):
        prompt = prompt_ids(trainer.tokenizer, task.episode(seed).messages)
        for j in range(group):
            completion = tuple(int(t) for t in rng.integers(100, 20000, size=tokens))
            samples.append(TrainSample(prompt, completion, tuple([-2.0] * tokens), (1,) * tokens, float(j % 2), seed))
    return samples


def plain_step(trainer: Trainer, samples: list[TrainSample]) -> None:
    """A hand-written GRPO step: the reference."""
    model, opt = trainer.model, trainer.optimizer
    model.train()
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    ids = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros((len(samples), length - 1))
    for i, s in enumerate(samples):
        ids[i, : len(s.prompt_ids) + len(s.completion_ids)] = torch.tensor(s.prompt_ids + s.completion_ids)
        mask[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.completion_ids)] = 1
    rewards = torch.tensor([s.reward for s in samples]).view(-1, 8)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    opt.zero_grad()
    logits = model(input_ids=ids).logits[:, :-1] / trainer.temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(adv * logp * mask).sum() / mask.sum()
    loss.backward()
    opt.step()


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    config = TrainerConfig(learning_rate=3e-4, threads=args.threads)
    trainer = Trainer(demo_model_path(), config, temperature=1.0)
    samples = demo_batch(trainer)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    print(f"batch: {len(samples)} samples, {tokens} tokens, {torch.get_num_threads()} threads", flush=True)
    results = {}
    seeds = list(range(len(samples)))
    for name, fn in (("plain", lambda: plain_step(trainer, samples)), ("trainer", lambda: trainer.step(samples)),
                     ("verify", lambda: trainer.evidence(samples, seeds))):
        fn()  # warm-up: allocator, kernels
        results[name] = timed(fn, args.repeats)
        print(f"{name:10} " + " ".join(f"{t:.2f}" for t in results[name]) + f"   median {statistics.median(results[name]):.2f} s",
              flush=True)
    plain, step = statistics.median(results["plain"]), statistics.median(results["trainer"])
    verify = statistics.median(results["verify"])
    print(json.dumps(dict(step_seconds=round(step, 2), plain_seconds=round(plain, 2), step_over_plain=round(step / plain, 3),
                          verify_seconds=round(verify, 2), verify_over_step=round(verify / step, 3),
                          samples=len(samples), threads=torch.get_num_threads())))


if __name__ == "__main__":
    main()

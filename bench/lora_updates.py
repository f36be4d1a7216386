"""LoRA updates as a run publishes them: what each weighs, and how far the nodes' adapter lags the
trainer's, per encoding, side by side on one real training trajectory.

SmolLM2-135M-Instruct (the shipped Q4_1 file, dequantized), LoRA r=16 and the default learning
rate: the llama.cpp node samples a batch of demo prompts once, and the trainer takes `--steps` GRPO
steps on it (rewards from the task). After each step every encoding publishes the new adapter with
error feedback (`echo_coordinator.publish.Publisher`: a bf16 snapshot first, then deltas against
the bf16 adapter nodes hold). The lag is the mean per-token KL(trainer || nodes) over the whole
vocabulary at the batch's completion positions; beside it, the KL between the trainer and itself
one version earlier (one version of staleness), as a yardstick.

    .venv/bin/python bench/lora_updates.py [--steps 12] [--densities 0.05 0.25]

Ends with a JSON line: per encoding, `bytes_ratio` (a delta update / the bf16 checkpoint, median)
and `lag_kl` (median over steps 2..), plus `one_version_kl`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.main import demo_model_path  # noqa: E402
from echo_coordinator.publish import Publisher  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402
from engines.backend import generate_one  # noqa: E402
from engines.hf import prompt_ids  # noqa: E402
from engines.llama_backend import LlamaBackend  # noqa: E402
from protocols.signing import generate_key  # noqa: E402
from tasks import make_task  # noqa: E402


def node_batch(trainer: Trainer, prompts: int, group: int, tokens: int) -> list[TrainSample]:
    """Real completions of demo prompts from the llama.cpp node, scored by the task."""
    task = make_task("arithmetic", {"digits": 1})
    node = LlamaBackend(demo_model_path(), threads=2, n_ctx=512)
    samples = []
    for seed in range(prompts):
        problem = task.generate(seed)
        prompt = prompt_ids(trainer.tokenizer, task.episode(seed).messages)
        for j in range(group):
            out = generate_one(node, prompt, tokens, 1.0, 1000 * seed + j)
            text = trainer.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
            samples.append(TrainSample(prompt, out.token_ids, out.logprobs, (1,) * len(out.token_ids),
                                       task.reward(problem, text), seed))
    return samples


@torch.no_grad()
def distributions(trainer: Trainer, samples: list[TrainSample], weights) -> torch.Tensor:
    """(N, V) log-probabilities at every completion position of `samples` under `weights`."""
    with trainer.holding(weights):
        trainer.model.eval()
        ids, mask, _ = trainer._pack(samples)
        return torch.log_softmax(trainer._scaled_logits(ids, mask > 0).double(), -1)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.25], help="topk-int8 densities")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    args = parser.parse_args()
    trainer = Trainer(demo_model_path(), TrainerConfig(threads=2), temperature=1.0)
    checkpoint = 2 * sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" not in n
                         and not (trainer.model.config.tie_word_embeddings and n.endswith("lm_head.weight")))
    samples = node_batch(trainer, args.prompts, args.group, 32)
    encodings = {"dense-int4": ("dense-int4", 1.0), **{f"topk-int8 {d}": ("topk-int8", d) for d in args.densities},
                 "dense-bf16": ("dense-bf16", 1.0)}
    key = generate_key()
    publishers = {name: Publisher("bench", key, "lora", None, enc, d, 10**9, {"alpha": 32.0})
                  for name, (enc, d) in encodings.items()}
    sizes: dict[str, list[float]] = {name: [] for name in encodings}
    lags: dict[str, list[float]] = {name: [] for name in encodings}
    yardstick, previous = [], None
    print(f"batch: {len(samples)} samples, reward {np.mean([s.reward for s in samples]):.2f}; "
          f"bf16 checkpoint {checkpoint / 1e6:.1f} MB", flush=True)
    for version in range(1, args.steps + 1):
        trainer.step(samples)
        weights = trainer.weights()
        trained = distributions(trainer, samples, None)
        if previous is not None:
            yardstick.append(kl(trained, distributions(trainer, samples, previous)))
        previous = weights
        line = [f"v{version:<3}"]
        for name, publisher in publishers.items():
            (update, store), = publisher.publish(version, weights)
            if not update.replaces:
                sizes[name].append(sum(map(len, store.values())) / checkpoint)
                lags[name].append(kl(trained, distributions(trainer, samples, publisher.view())))
                line.append(f"{name} {100 * sizes[name][-1]:.2f} % KL {lags[name][-1]:.2e}")
        if yardstick:
            line.append(f"one version {yardstick[-1]:.2e}")
        print("  ".join(line), flush=True)
    print(f"\n{'encoding':<18}{'update / bf16 ckpt':>20}{'lag KL (median)':>17}{'lag / one version':>19}")
    one = statistics.median(yardstick)
    result = {}
    for name in encodings:
        size, lag = statistics.median(sizes[name]), statistics.median(lags[name])
        result[name] = dict(bytes_ratio=round(size, 5), lag_kl=float(f"{lag:.3g}"))
        print(f"{name:<18}{100 * size:>19.2f}%{lag:>17.2e}{lag / one:>19.2f}")
    print(json.dumps(dict(encodings=result, one_version_kl=float(f"{one:.3g}"), steps=args.steps,
                          samples=len(samples), checkpoint_bf16_bytes=checkpoint)))


if __name__ == "__main__":
    main()

"""The trainer on a GPU: tokens/s of its full-parameter GRPO step against plain HF + fused AdamW
on the same batch, side by side in one run.

Random Qwen2-0.5B- and Qwen2-1.5B-shaped models (bf16 weights, as the trainer loads on a GPU),
a batch of 8 samples x 1024 tokens (16 prompt + 1008 completion tokens). The plain loop is
what one writes by hand: the model's forward with SDPA attention, full-vocabulary log-softmax
over every position, -A * logprob, backward, `torch.optim.AdamW(fused=True)`. The trainer is
`echo_coordinator.trainer.Trainer` in full mode (bf16 compute over fp32 master weights, so that a
step at lr 1e-6 is not rounded away, fused AdamW; the vocabulary projection and softmax only at
completion positions; micro-batches of `micro_batch_tokens`). Beside tok/s, each one's peak GPU
memory: the master weights' cost (fp32 weights, gradients and AdamW state, a bf16 copy in a step).
Reference (DESIGN.md, plain HF + fused AdamW bf16 on an H200): 72k tok/s (0.5B), 38.7k (1.5B).

    .venv/bin/python bench/gpu_trainer.py [--shapes 0.5b 1.5b] [--steps 10] [--compile]
    .venv/bin/python bench/gpu_trainer.py --quick     # a tiny shape on the CPU: checks the script

Ends with a JSON line: per shape, `trainer_tokens_per_s`, `plain_tokens_per_s`,
`ratio_trainer_over_plain` (medians over the timed steps, after 2 warm-up steps) and
`trainer_peak_gib`, `plain_peak_gib`.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402

SHAPES = {  # Qwen2 configs (config.json of Qwen2-0.5B / Qwen2-1.5B)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152),
}


def checkpoint(shape: str, directory: Path, tokenizer: Path | None = None) -> Path:
    """A random bf16 checkpoint of the shape, with the SmolLM2 tokenizer (ids < every vocab here;
    `tokenizer`: its files, on a machine without the demo model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tokenizer is None:
        from tests.support.tiny_model import _smollm2_tokenizer_dir

        tokenizer = _smollm2_tokenizer_dir()

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    for f in tokenizer.iterdir():
        shutil.copy(f, directory / f.name)
    return directory


def batch(samples: int, prompt: int, completion: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(samples):
        ids = torch.randint(100, 40000, (prompt + completion,), generator=g).tolist()
        out.append(TrainSample(tuple(ids[:prompt]), tuple(ids[prompt:]), (-2.0,) * completion, (1,) * completion,
                               float(i % 2), i // 4))  # groups of 4 with mixed rewards: every sample trains
    return out


def plain_step(model, optimizer, samples: list[TrainSample], device) -> None:
    ids = torch.tensor([s.prompt_ids + s.completion_ids for s in samples], device=device)
    p = len(samples[0].prompt_ids)
    adv = torch.tensor([1.0 if s.reward else -1.0 for s in samples], device=device)[:, None]
    logits = model(input_ids=ids).logits[:, p - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None]).squeeze(-1)
    loss = -(adv * logp).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn, steps: int, sync) -> list[float]:
    out = []
    for i in range(steps + 2):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        if i >= 2:  # warm-up: allocator, kernels, compilation
            out.append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="torch.compile the plain model and the trainer's")
    parser.add_argument("--quick", action="store_true", help="tiny shape, 2 x 128 tokens, on the CPU")
    parser.add_argument("--tokenizer", type=Path, help="a directory of HF tokenizer files (default: the demo model's)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        raise SystemExit("no GPU here: this bench measures the GPU path (use --quick to check the script on the CPU)")
    shapes, (samples, prompt, completion) = (["tiny"], (2, 16, 112)) if args.quick else (args.shapes, (8, 16, 1008))
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    data = batch(samples, prompt, completion)
    tokens = samples * (prompt + completion)
    results = {}
    for shape in shapes:
        with tempfile.TemporaryDirectory(prefix=f"echo-gpu-{shape}-") as tmp:
            path = checkpoint(shape, Path(tmp), args.tokenizer)
            from transformers import AutoModelForCausalLM

            dtype = torch.bfloat16 if cuda else torch.float32
            peak = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
            peak()
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
            forward = torch.compile(model) if args.compile else model
            plain = timed(lambda: plain_step(forward, optimizer, data, device), args.steps, sync)
            plain_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            del model, forward, optimizer
            if cuda:
                torch.cuda.empty_cache()
            peak()
            trainer = Trainer(path, TrainerConfig(learning_rate=1e-6, micro_batch_tokens=8192,
                                                  device="cuda" if cuda else "cpu"), 1.0, update="full")
            if args.compile:
                trainer.model.model = torch.compile(trainer.model.model)
            ours = timed(lambda: trainer.step(data), args.steps, sync)
            ours_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            del trainer
            if cuda:
                torch.cuda.empty_cache()
        p, t = tokens / statistics.median(plain), tokens / statistics.median(ours)
        results[shape] = dict(trainer_tokens_per_s=round(t), plain_tokens_per_s=round(p),
                              ratio_trainer_over_plain=round(t / p, 3), trainer_peak_gib=round(ours_peak, 1),
                              plain_peak_gib=round(plain_peak, 1))
        print(f"{shape}: trainer {t:,.0f} tok/s ({ours_peak:.1f} GiB), plain HF + fused AdamW {p:,.0f} tok/s "
              f"({plain_peak:.1f} GiB), ratio {t / p:.3f}", flush=True)
    print(json.dumps(dict(shapes=results, device=torch.cuda.get_device_name() if cuda else "cpu",
                          batch=f"{samples}x{prompt + completion}", compile=args.compile, steps=args.steps)))


if __name__ == "__main__":
    main()

"""Bring your own model, measured on SmolLM2-135M-Instruct: what the coordinator's conversion costs
and how far each node quant's samples are from the full-precision trainer.

The HF checkpoint is SmolLM2-135M-Instruct as transformers dequantizes the shipped Q4_1 GGUF
(the only copy here: nothing downloads), saved as safetensors. Per node quant, the coordinator's
own conversion (`base_model.convert`): seconds to write the fp32 GGUF and to quantize, and the
file size. Then a llama.cpp node on that GGUF samples `--group` completions of `--prompts`
arithmetic prompts with the run's Gumbel-max sampler (T = 1, 32 new tokens), and the fp32 trainer
scores the same tokens: the mismatch KL per token as metrics.jsonl reports it (k3 estimator of
KL(mu || pi)). Then the share of these honest leases the verification rule rejects, checked
against the fp32 trainer and against the node's own GGUF dequantized (what the coordinator
checks against: should be 0).

    .venv/bin/python bench/node_quant.py [--prompts 16] [--group 4] [--quants f16 q8_0 q4_k_m q4_1]

Ends with a JSON line: per quant, convert_s, quantize_s, mb, mismatch_kl, rejected_vs_trainer,
rejected_vs_own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from verification import evidence_of, sample_lease, verdicts  # noqa: E402

from echo_coordinator import base_model  # noqa: E402
from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.main import demo_model_path  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402
from engines.hf import prompt_ids  # noqa: E402
from engines.llama_backend import LlamaBackend  # noqa: E402
from protocols.sampling import SamplingRule  # noqa: E402
from tasks import make_task  # noqa: E402

LEASE = 4  # prompts a lease judges together


def hf_checkpoint(directory: Path) -> Path:
    """SmolLM2 as an HF safetensors checkpoint (the shipped GGUF, dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.hf import load_model, load_tokenizer

    gguf = demo_model_path()
    model = load_model(gguf, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):  # (transformers before 5 kept it)
        del model.config.quantization_config  # dequantized floats: save them as a plain checkpoint
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(directory)
    load_tokenizer(gguf).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--quants", nargs="+", default=["f16", "q8_0", "q4_k_m", "q4_1"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="echo-node-quant-"))
    checkpoint = hf_checkpoint(work / "smollm2-hf")
    trainer = Trainer(checkpoint, TrainerConfig(threads=args.threads), temperature=1.0)
    task = make_task("arithmetic", {"digits": 1})
    prompts = {seed: prompt_ids(trainer.tokenizer, task.episode(seed).messages) for seed in range(args.prompts)}
    rule, results = SamplingRule(), {}
    print(f"{'quant':<8}{'convert s':>10}{'quantize s':>11}{'MB':>8}{'tokens':>8}{'mismatch KL':>13}"
          f"{'rejected vs trainer':>21}{'vs own GGUF':>13}")

    def rejected(checker, samples) -> float:
        judged = verdicts(evidence_of(checker, "bench", samples, None), LEASE * args.group, rule)
        leases = judged[:: LEASE * args.group]
        return sum(v is not None for v in leases) / len(leases)

    for quant in args.quants:
        out = work / f"smollm2-{quant}.gguf"
        timings = {}
        base_model.convert(checkpoint, out, quant, timings=timings)
        node = LlamaBackend(out, threads=args.threads, n_ctx=1024)
        samples = sample_lease(node, "bench", prompts, args.group, 1.0)
        train = [TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, 0.0, s.seed) for s in samples]
        log_w = np.concatenate([t - np.array(s.behaviour) for t, s in zip(trainer.logprobs(train), train)])
        kl = float(np.mean(np.exp(log_w) - 1 - log_w))  # k3 of KL(mu || pi), as grpo.py reports it
        own = Trainer(out, TrainerConfig(threads=args.threads), temperature=1.0)
        results[quant] = dict(convert_s=round(timings["convert_s"], 2), quantize_s=round(timings["quantize_s"], 2),
                              mb=round(out.stat().st_size / 1e6, 1), tokens=len(log_w), mismatch_kl=round(kl, 5),
                              rejected_vs_trainer=rejected(trainer, samples), rejected_vs_own=rejected(own, samples))
        r = results[quant]
        print(f"{quant:<8}{r['convert_s']:>10.2f}{r['quantize_s']:>11.2f}{r['mb']:>8.1f}{r['tokens']:>8}"
              f"{r['mismatch_kl']:>13.5f}{r['rejected_vs_trainer']:>21.2f}{r['rejected_vs_own']:>13.2f}")
        del node, own
    print(json.dumps({"model": "SmolLM2-135M-Instruct", "prompts": args.prompts, "group": args.group, **results}))


if __name__ == "__main__":
    main()

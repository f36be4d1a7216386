"""Calibrating the sampling rule on greedy evaluation answers: honest Q4_1 and Q8_0 nodes answer
held-out prompts by argmax (zero noise), the fp32 trainer checks them with the rule that checks
sampled rollouts (`protocols.sampling.judge`), a lease of `--lease` answers at a time.

Versions: the base model (0) and the trained adapters given with `--adapter` (e.g. a demo run's
`runs/demo-*/adapters/v10.safetensors`). Cheats, per version: sampling at the run's temperature
where greedy was asked, the gold answer written with made-up logprobs, and an honest greedy
answer whose final number is replaced by the gold one.

    .venv/bin/python bench/verify_greedy.py [--prompts 256] [--lease 16] [--adapter FILE ...]

Prints, per node kind and version, flipped tokens, the margin quantiles and false rejections, and
per cheat its detection rate; ends with a JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from verification import MAX_NEW, Nodes, quantiles, verdicts  # noqa: E402

from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.main import demo_model_path  # noqa: E402
from echo_coordinator.evaluation import eval_seeds  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402
from engines.backend import generate_one  # noqa: E402
from engines.hf import prompt_ids  # noqa: E402
from echo_coordinator.verify import lora_base  # noqa: E402
from protocols.messages import RolloutSample  # noqa: E402
from protocols.sampling import SamplingRule, sample_seed  # noqa: E402
from tasks import make_task  # noqa: E402


def answer(backend, prompts: dict[int, tuple[int, ...]], noise: bool = False) -> list[RolloutSample]:
    out = []
    for seed, prompt in prompts.items():
        g = generate_one(backend, prompt, MAX_NEW, 1.0, sample_seed("cheat", seed, 0) if noise else None)
        out.append(RolloutSample(seed, prompt, g.token_ids, g.logprobs))
    return out


def check(trainer, samples: list[RolloutSample], weights) -> list:
    train = [TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, 0.0, s.seed) for s in samples]
    return trainer.evidence(train, [None] * len(samples), weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--cheat-prompts", type=int, default=64)
    parser.add_argument("--lease", type=int, default=16, help="answers judged together (an evaluation lease)")
    parser.add_argument("--kinds", default="q4_1,q8_0")
    parser.add_argument("--adapter", type=Path, action="append", default=[])
    args = parser.parse_args()
    rule, model, task = SamplingRule(), demo_model_path(), make_task("arithmetic", {"digits": 1})
    trainer = Trainer(model, TrainerConfig(threads=2), 1.0)
    tokenizer, eos = trainer.tokenizer, trainer.tokenizer.eos_token_id
    import tempfile

    nodes = Nodes(args.kinds.split(","), model, Path(tempfile.mkdtemp(prefix="echo-greedy-")))
    prompts = {s: prompt_ids(tokenizer, task.episode(s).messages) for s in eval_seeds(args.prompts)}
    cheat_prompts = dict(list(prompts.items())[: args.cheat_prompts])
    versions = [(0, lora_base(trainer.weights()))] + [(i + 1, load_file(str(p))) for i, p in enumerate(args.adapter)]
    honest_rows, cheat_rows = [], []
    print(f"{'node':6}{'v':>3}{'answers':>9}{'tokens':>8}{'flip %':>8}  max margin p50/p99/p99.9/max   rejected  accuracy")
    for version, weights in versions:
        nodes.bring_to(version, weights, trainer.config.lora_alpha)
        for kind, backend in nodes.backends.items():
            samples = answer(backend, prompts)
            found = check(trainer, samples, weights)
            rejected = sum(v is not None for v in verdicts(found, args.lease, rule))
            tokens, flips = sum(e.tokens for e in found), sum(e.flips for e in found)
            accuracy = np.mean([task.reward(task.generate(s.seed), tokenizer.decode(list(s.completion_ids),
                                                                                    skip_special_tokens=True))
                                for s in samples])
            honest_rows.append(dict(kind=kind, version=version, answers=len(samples), tokens=tokens, flips=flips,
                                    rejected=rejected, max_margin=max(e.max_margin for e in found)))
            print(f"{kind:6}{version:>3}{len(samples):>9}{tokens:>8}{100 * flips / tokens:>8.2f}  "
                  f"{quantiles([e.max_margin for e in found]):30}{rejected:>9}{accuracy:>10.3f}", flush=True)
        node = nodes.backends["q4_1"] if "q4_1" in nodes.backends else next(iter(nodes.backends.values()))
        honest = answer(node, cheat_prompts)
        gold = {s: tuple(tokenizer(f"The answer is {task.generate(s).answer}.", add_special_tokens=False).input_ids)
                + (eos,) for s in cheat_prompts}
        built = {
            "sampled at T where greedy was asked": answer(node, cheat_prompts, noise=True),
            "gold answer, made-up logprobs": [dataclasses.replace(s, completion_ids=gold[s.seed],
                                                                  logprobs=(-0.05,) * len(gold[s.seed])) for s in honest],
            "greedy text + written gold answer": [
                dataclasses.replace(s, completion_ids=(s.completion_ids[: max(1, len(s.completion_ids) - len(gold[s.seed]))]
                                                       + gold[s.seed])[:MAX_NEW],
                                    logprobs=(s.logprobs + (-1.0,) * MAX_NEW)[:MAX_NEW]) for s in honest],
        }
        for name, samples in built.items():
            samples = [dataclasses.replace(s, logprobs=s.logprobs[: len(s.completion_ids)]) for s in samples]
            changed = [s.completion_ids != h.completion_ids for s, h in zip(samples, honest)]
            found = check(trainer, samples, weights)
            caught = [v is not None for v in verdicts(found, args.lease, rule)]
            n = sum(changed)
            hit = sum(c for c, ch in zip(caught, changed) if ch)
            cheat_rows.append(dict(cheat=name, version=version, changed=n, caught=hit))
            print(f"  cheat v{version} {name}: {hit}/{n} changed answers refused", flush=True)
    total = sum(r["answers"] for r in honest_rows)
    print(json.dumps(dict(
        honest_answers=total, false_rejections=sum(r["rejected"] for r in honest_rows),
        flip_fraction=round(sum(r["flips"] for r in honest_rows) / max(sum(r["tokens"] for r in honest_rows), 1), 4),
        max_margin=round(max(r["max_margin"] for r in honest_rows), 3),
        detection={r["cheat"] + f" v{r['version']}": f"{r['caught']}/{r['changed']}" for r in cheat_rows},
        lease=args.lease, versions=len(versions),
    )))


if __name__ == "__main__":
    main()

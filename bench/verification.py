"""Calibrating sampling verification on real nodes: honest margins, cheat detection, cost.

A small real RL loop on SmolLM2-135M-Instruct (the demo task): at each version the trainer (fp32,
LoRA r=16) is the verifier, and honest nodes of several kinds sample the demo prompts with the
lease noise: llama.cpp on the shipped Q4_1 file, llama.cpp on Q8_0 and Q4_K_M files quantized
from the trainer's fp32 weights, and the transformers backend (fp32, the LoRA merged in). Every
sample is verified against the trainer's logits for its version; then the trainer takes a GRPO
step on the Q4_1 samples, so later versions carry real trained adapters. Cheats are built from
the same prompts at each version and verified the same way.

A llama.cpp kind may name the batch it decodes, `q4_1@32`: a node with `--parallel 32`, whose
leases hold enough prompts to fill it (`--lease-seeds` or B / G, whichever is more); every kind
decodes a lease's samples together, so `q4_1@1` is one sequence at a time.

    .venv/bin/python bench/verification.py [--versions 4] [--seeds q4_1@8=144,q8_0@8=144,q4_k_m@8=32,transformers=8]
        [--group 8] [--cheat-seeds 4] [--temperature 1.0] [--evidence FILE.jsonl] [--from-version 0]
        [--model RUN.gguf --seeds file=144]   # another run file: the trainer trains it dequantized
    .venv/bin/python bench/verification.py --summarize FILE.jsonl   # re-judge recorded evidence

Samples are judged a lease at a time (`--lease-seeds` prompts of G samples, as the demo leases),
because the rule has per-batch parts.

Prints, per node kind, the distribution of the largest margin and of the logprob error per sample,
the share of tokens whose logprob error is large (past `LARGE_LOGPROB_ERROR`; `--large-error X`
counts past X instead) overall and in the worst lease, and the false rejections under the shipped rule; per cheat, the share of cheated samples rejected;
the verification cost beside the training step; and a final JSON line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.main import demo_model_path  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402
from engines.backend import Request  # noqa: E402
from engines.hf import prompt_ids  # noqa: E402
from echo_coordinator.verify import lora_base  # noqa: E402
from protocols.sampling import sample_seeds  # noqa: E402
from engines.full_weights import export_quantized  # noqa: E402
from engines.hf import load_master  # noqa: E402
from engines.gguf_io import write_lora_adapter  # noqa: E402
from engines.llama_backend import LlamaBackend  # noqa: E402
from protocols.messages import RolloutSample  # noqa: E402
from protocols.sampling import SampleEvidence, SamplingRule, judge  # noqa: E402
from tasks import make_task  # noqa: E402

FTYPES = {"q8_0": 7, "q4_k_m": 15}  # llama.cpp file types
MAX_NEW = 32


def quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    q = np.quantile(values, [0.5, 0.99, 0.999]) if len(values) >= 10 else [np.median(values)] * 3
    return f"{q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} / {max(values):.3f}"


class Nodes:
    """The honest node kinds, each brought to a version's weights before it samples."""

    def __init__(self, kinds: list[str], model: Path, work: Path, threads: int = 2, kv: str | None = None):
        self.model, self.work, self.kinds = model, work, kinds
        self.backends = {}
        config, base = load_master(model)
        self.hf_config, self.base = config, base
        for kind in kinds:
            quant, parallel = kind.split("@") if "@" in kind else (kind, "8")
            if quant in ("q4_1", "file"):  # llama.cpp on the run's file (the shipped Q4_1 unless --model)
                self.backends[kind] = LlamaBackend(model, threads=threads, n_ctx=512, parallel=int(parallel), kv=kv)
            elif quant in FTYPES:
                path = work / f"{quant}.gguf"
                if not path.exists():
                    export_quantized(config, base, model, path, FTYPES[quant])
                self.backends[kind] = LlamaBackend(path, threads=threads, n_ctx=512, parallel=int(parallel), kv=kv)
            elif kind == "transformers":
                from engines.transformers_backend import TransformersBackend

                self.backends[kind] = TransformersBackend(model, threads=threads)
            else:
                raise SystemExit(f"unknown node kind {kind}")

    def bring_to(self, version: int, adapter: dict[str, np.ndarray], alpha: float) -> None:
        for kind, backend in self.backends.items():
            if kind == "transformers":
                backend.load_weights(merged(self.base, adapter, alpha) if version else self.base)
                continue
            if version == 0:
                backend.set_adapter(None)
                continue
            path = self.work / f"{kind}-v{version}.gguf"
            write_lora_adapter(adapter, alpha, path, backend.layout)
            backend.set_adapter(path)


def merged(base: dict[str, np.ndarray], adapter: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """Full weights of base + LoRA (what a transformers node in a full-mode run would hold)."""
    out = dict(base)
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        target = name.split("base_model.model.", 1)[1].replace(".lora_A.weight", ".weight")
        out[target] = base[target] + (alpha / a.shape[0]) * (b @ a)
    return out


def sample_lease(backend, lease: str, prompts: dict[int, tuple[int, ...]], group: int, temperature: float,
                 noise_lease: str | None = None) -> list[RolloutSample]:
    """G samples per seed as an honest node makes them, decoded together (noise of `noise_lease`,
    default the lease's)."""
    order = [(seed, prompt) for seed, prompt in prompts.items() for _ in range(group)]
    noise = sample_seeds(noise_lease or lease, [seed for seed, _ in order])
    outs = backend.generate([Request(prompt, MAX_NEW, n) for (_, prompt), n in zip(order, noise)], temperature)
    return [RolloutSample(seed, prompt, out.token_ids, out.logprobs) for (seed, prompt), out in zip(order, outs)]


def evidence_of(trainer, lease: str, samples: list[RolloutSample], weights) -> list:
    train = [TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, 0.0, s.seed) for s in samples]
    return trainer.evidence(train, sample_seeds(lease, [x.seed for x in samples]), weights)


def cheats(trainer, node, lease: str, honest: list[RolloutSample], task, temperature: float, group: int,
           tokenizer, eos: int, adapter: Path | None) -> dict[str, list[RolloutSample]]:
    """Each cheat as the batch a cheating node would push for this lease (same prompts and seeds)."""
    prompts = {s.seed: s.prompt_ids for s in honest}
    gold = {seed: tuple(tokenizer(f"The answer is {task.generate(seed).answer}.", add_special_tokens=False).input_ids)
            + (eos,) for seed in prompts}
    teacher = trainer.logprobs([TrainSample(s.prompt_ids, gold[s.seed], (0.0,) * len(gold[s.seed]),
                                            (1,) * len(gold[s.seed]), 0.0, s.seed) for s in honest])
    out = {
        "gold answer, made-up logprobs": [dataclasses.replace(s, completion_ids=gold[s.seed],
                                                              logprobs=(-0.05,) * len(gold[s.seed])) for s in honest],
        "gold answer, teacher-forced logprobs": [
            dataclasses.replace(s, completion_ids=gold[s.seed], logprobs=tuple(float(x) for x in t))
            for s, t in zip(honest, teacher)],
    }
    appended = []
    for s in honest:
        keep = s.completion_ids[: max(1, len(s.completion_ids) - len(gold[s.seed]) - 1)]
        if keep[-1] == eos:
            keep = keep[:-1] or (tokenizer(" ok", add_special_tokens=False).input_ids[0],)
        ids = (keep + gold[s.seed])[:MAX_NEW]
        appended.append(dataclasses.replace(s, completion_ids=ids, logprobs=(s.logprobs + (-1.0,) * MAX_NEW)[: len(ids)]))
    out["honest text + written answer"] = appended
    out["one sample copied G times"] = [honest[i - i % group] for i in range(len(honest))]
    out["logprobs shaded down 0.3"] = [dataclasses.replace(s, logprobs=tuple(x - 0.3 for x in s.logprobs))
                                       for s in honest]
    # Concentrated: every 40th token of the batch shaded just under the per-token limit, so the
    # pooled mean stays near an honest one while those tokens train at the TIS cap.
    count = 0
    concentrated = []
    for s in honest:
        shaded = []
        for x in s.logprobs:
            count += 1
            shaded.append(x - 2.4 if count % 40 == 0 else x)
        concentrated.append(dataclasses.replace(s, logprobs=tuple(shaded)))
    out["2.5 % of tokens shaded down 2.4"] = concentrated
    for factor in (0.5, 2.0):
        out[f"honest sampling at T x {factor}"] = sample_lease(node, lease, prompts, group, temperature * factor)
    out["another sampler (top-k 40, top-p 0.95)"] = other_sampler(node, honest, temperature, adapter)
    return out


def other_sampler(node, honest: list[RolloutSample], temperature: float, adapter: Path | None) -> list[RolloutSample]:
    """llama.cpp's own default sampler: what a node that ignores the lease's noise would send.
    Its own `Llama` (the node's only tokenizes), with the version's adapter."""
    import ctypes

    import llama_cpp

    llm = llama_cpp.Llama(str(node.model_path), n_ctx=512, verbose=False, n_threads=2, type_k=0, type_v=0,
                          n_gpu_layers=0)  # fp32 KV, as the node's; on the CPU, beside a node on a GPU backend
    if adapter is not None:
        lora = llama_cpp.llama_adapter_lora_init(llm.model, str(adapter).encode())
        llama_cpp.llama_set_adapters_lora(llm.ctx, (llama_cpp.llama_adapter_lora_p_ctypes * 1)(lora), 1,
                                          (ctypes.c_float * 1)(1.0))
    out = []
    for i, s in enumerate(honest):
        llm.set_seed(1000 + i)
        ids: list[int] = []
        for token in llm.generate(list(s.prompt_ids), temp=temperature, top_k=40, top_p=0.95, reset=True):
            ids.append(token)
            if token == node.eos or len(ids) >= MAX_NEW:
                break
        out.append(dataclasses.replace(s, completion_ids=tuple(ids), logprobs=(-1.0,) * len(ids)))
    return out


def train(trainer, task, tokenizer, batch: list[RolloutSample]) -> list[float]:
    """One GRPO step on `batch`, scored by the task; returns the rewards."""
    rewards = [task.reward(task.generate(s.seed), tokenizer.decode(list(s.completion_ids), skip_special_tokens=True))
               for s in batch]
    trainer.step([TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, r, s.seed)
                  for s, r in zip(batch, rewards)])
    return rewards


def lease_seeds(standard: int, backend, group: int) -> int:
    """Prompts in one lease of this node: the standard lease, or enough to fill its batch."""
    return max(standard, -(-getattr(backend, "parallel", 1) // group))


def verdicts(evidence: list[SampleEvidence], lease_size: int, rule: SamplingRule) -> list[str | None]:
    """The rule's verdict for each sample, judged a lease (`lease_size` samples) at a time: a
    rejected lease rejects all of its samples."""
    out: list[str | None] = []
    for a in range(0, len(evidence), lease_size):
        part = evidence[a : a + lease_size]
        out += [judge(part, rule)] * len(part)
    return out


def summarize(records: list[dict], lease_size: int, rule: SamplingRule) -> dict:
    fields = {f.name for f in dataclasses.fields(SampleEvidence)}
    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    print(f"\n{'honest node':<14}{'samples':>8}{'tokens':>8}{'flip %':>8}  max margin p50/p99/p99.9/max"
          f"        logprob err mean p50/p99/p99.9/max   large errors %  worst lease  rejected")
    false_rejections, detection = {}, {}
    cheat_rows = []
    for kind, rows in by_kind.items():
        evidence = [SampleEvidence(**{k: v for k, v in r.items() if k in fields}) for r in rows]
        if rows[0].get("cheat"):
            changed = [r["changed"] for r in rows]
            # A lease of cheated samples (the unchanged originals of a copied group stay in it).
            judged = verdicts(evidence, lease_size, rule)
            tokens_only = verdicts([dataclasses.replace(e, max_logprob_error=0.0, mean_logprob_error=0.0,
                                                        large_errors=0)
                                    for e in evidence], lease_size, rule)
            n = sum(changed)
            rate = sum(v is not None for v, c in zip(judged, changed) if c) / max(n, 1)
            by_tokens = sum(v is not None for v, c in zip(tokens_only, changed) if c) / max(n, 1)
            detection[kind] = round(rate, 4)
            cheat_rows.append((kind, n, rate, by_tokens))
            continue
        tokens = sum(e.tokens for e in evidence)
        flips = sum(e.flips for e in evidence)
        size = rows[0].get("lease_size", lease_size)  # a node's lease fills its batch
        false_rejections[kind] = sum(v is not None for v in verdicts(evidence, size, rule))
        large = sum(e.large_errors for e in evidence)
        per_lease = max(sum(e.large_errors for e in evidence[a : a + size]) / sum(e.tokens for e in evidence[a : a + size])
                        for a in range(0, len(evidence), size))
        print(f"{kind:<14}{len(rows):>8}{tokens:>8}{100 * flips / max(tokens, 1):>7.2f}%  "
              f"{quantiles([e.max_margin for e in evidence]):<34}"
              f"{quantiles([e.mean_logprob_error for e in evidence]):<38}"
              f"{100 * large / max(tokens, 1):>6.3f} %  {100 * per_lease:>8.2f} %   {false_rejections[kind]}")
    print(f"\n{'cheat':<45}{'samples':>8}{'rejected':>10}{'by tokens':>11}")
    for name, n, rate, by_tokens in cheat_rows:
        print(f"{name:<45}{n:>8}{100 * rate:>9.1f}%{100 * by_tokens:>10.1f}%")
    return dict(honest_samples=sum(len(r) for k, r in by_kind.items() if not r[0].get("cheat")),
                false_rejections=sum(false_rejections.values()), false_rejections_by_node=false_rejections,
                detection=detection, rule=dataclasses.asdict(rule), lease_size=lease_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--seeds", default="q4_1@8=144,q8_0@8=144,q4_k_m@8=32,transformers=8",
                        help="node kinds and prompts per version for each")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--task", default="arithmetic", help="the prompts' task (a registry name or module:Class)")
    parser.add_argument("--lease-seeds", type=int, default=2, help="prompts per lease (the demo's)")
    parser.add_argument("--cheat-seeds", type=int, default=4, help="prompts per version for each cheat")
    parser.add_argument("--train-seeds", type=int, default=8, help="prompts per GRPO step")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2, help="the trainer's and each node's threads")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--from-version", type=int, default=0,
                        help="only train (no calibration) below this version: to add later versions to a record")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="task seeds start here (+ 10,000 per version): a new part that repeats no earlier sample")
    parser.add_argument("--model", type=Path, default=None,
                        help="the run's GGUF (default: the shipped Q4_1); node kind 'file' runs it; 'tiny': a "
                             "random 2-layer Llama with SmolLM2's vocabulary as Q8_0, made here (the Vulkan runs')")
    parser.add_argument("--kv", choices=["f32", "f16"], default=None,
                        help="llama.cpp nodes' KV cache (f16 on a GPU backend: with flash attention); default: the node's choice")
    parser.add_argument("--evidence", type=Path, default=None, help="write every sample's evidence here (JSONL)")
    parser.add_argument("--summarize", type=Path, default=None, help="only re-judge the evidence in this file")
    parser.add_argument("--large-error", type=float, default=None,
                        help="count logprob errors past this as large (`large_errors`), to calibrate the threshold")
    args = parser.parse_args()
    if args.large_error is not None:
        import protocols.sampling

        protocols.sampling.LARGE_LOGPROB_ERROR = args.large_error
    rule, lease_size = SamplingRule(), args.lease_seeds * args.group
    if args.summarize:
        records = [json.loads(line) for line in args.summarize.read_text().splitlines()]
        print(json.dumps(summarize(records, lease_size, rule)))
        return

    seeds = {kind: int(n) for kind, n in (item.split("=") for item in args.seeds.split(","))}
    work = Path(tempfile.mkdtemp(prefix="echo-verify-"))
    model = args.model or demo_model_path()
    if str(model) == "tiny":
        sys.path.insert(0, str(ROOT / "bench"))
        from llama_raw import wide_model

        model = wide_model(work, 49152, "q8_0")
    task = make_task(args.task)
    trainer = Trainer(model, TrainerConfig(learning_rate=args.lr, threads=args.threads), args.temperature)
    tokenizer, eos = trainer.tokenizer, trainer.tokenizer.eos_token_id
    nodes = Nodes(list(seeds), model, work, args.threads, args.kv)
    records: list[dict] = []
    log = open(args.evidence, "w") if args.evidence else None

    def record(kind: str, version: int, samples, found, **extra) -> None:
        for s, e in zip(samples, found):
            records.append(dict(kind=kind, version=version, seed=s.seed, **dataclasses.asdict(e), **extra))
            if log:
                log.write(json.dumps(records[-1]) + "\n")
                log.flush()

    costs = []
    for version in range(args.versions):
        adapter = trainer.weights()
        held = lora_base(adapter) if version == 0 else adapter
        nodes.bring_to(version, adapter, trainer.config.lora_alpha)
        first = args.first_seed + 10_000 * (version + 1)
        if version < args.from_version:  # the training step alone, on the lease the calibration would use
            kind, backend = next(iter(nodes.backends.items()))
            prompts = {s: prompt_ids(tokenizer, task.generate(s).messages)
                       for s in range(first, first + args.train_seeds)}
            train_batch = []
            for a in range(0, args.train_seeds, args.lease_seeds):
                part = dict(list(prompts.items())[a : a + args.lease_seeds])
                train_batch += sample_lease(backend, f"cal-{kind}-v{version}-{a}", part, args.group, args.temperature)
            rewards = train(trainer, task, tokenizer, train_batch)
            print(f"v{version}: trained only, reward {statistics.mean(rewards):.3f}", flush=True)
            continue
        train_batch = None
        for kind, backend in nodes.backends.items():
            prompts = {s: prompt_ids(tokenizer, task.generate(s).messages) for s in range(first, first + seeds[kind])}
            items = list(prompts.items())
            per_lease = lease_seeds(args.lease_seeds, backend, args.group)
            generated, samples, found = 0.0, [], []
            for a in range(0, len(items), per_lease):  # one lease at a time, as a node works
                lease = f"cal-{kind}-v{version}-{a}"
                started = time.perf_counter()
                part = sample_lease(backend, lease, dict(items[a : a + per_lease]), args.group, args.temperature)
                generated += time.perf_counter() - started
                samples += part
                found += evidence_of(trainer, lease, part, held)
            record(kind, version, samples, found, lease_size=per_lease * args.group)
            tokens = sum(len(s.completion_ids) for s in samples)
            bad = sum(v is not None for v in verdicts(found, per_lease * args.group, rule))
            print(f"v{version} {kind}: {len(samples)} samples, {tokens / generated:.0f} tok/s, "
                  f"{sum(e.flips for e in found)} flipped tokens of {tokens}, {bad} rejected", flush=True)
            if train_batch is None:
                train_batch = samples[: args.train_seeds * args.group]
        # Cheats, from the first node kind's view of this version, one lease per cheat.
        node = next(b for k, b in nodes.backends.items() if k.split("@")[0] in ("q4_1", "file"))
        cheat_prompts = {s: prompt_ids(tokenizer, task.generate(s).messages)
                         for s in range(first + 5000, first + 5000 + args.cheat_seeds)}
        lease = f"cheat-v{version}"
        honest = sample_lease(node, lease, cheat_prompts, args.group, args.temperature)
        node_kind = next(k for k, b in nodes.backends.items() if b is node)
        adapter_file = work / f"{node_kind}-v{version}.gguf" if version else None
        built = cheats(trainer, node, lease, honest, task, args.temperature, args.group, tokenizer, eos, adapter_file)
        if version > 0 and isinstance(node, LlamaBackend):
            node.set_adapter(None)
            built["base model's text claimed as this version"] = sample_lease(node, lease, cheat_prompts, args.group,
                                                                             args.temperature)
            nodes.bring_to(version, adapter, trainer.config.lora_alpha)
        for name, samples in built.items():
            found = evidence_of(trainer, lease, samples, held)
            changed = [(s.completion_ids, s.logprobs) != (h.completion_ids, h.logprobs) for s, h in zip(samples, honest)]
            for s, e, c in zip(samples, found, changed):
                records.append(dict(kind=name, version=version, seed=s.seed, cheat=True, changed=c,
                                    **dataclasses.asdict(e)))
                if log:
                    log.write(json.dumps(records[-1]) + "\n")
        # Cost: verifying a batch beside training on it, same samples. The timed step trains on
        # every sample (alternating rewards) and is undone; then the real GRPO step runs.
        started = time.perf_counter()
        evidence_of(trainer, "cost", train_batch, held)
        verify_s = time.perf_counter() - started
        optimiser = copy.deepcopy(trainer.optimizer.state_dict())
        with trainer.holding(trainer.weights()):
            timed = trainer.step([TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, float(i % 2),
                                              s.seed) for i, s in enumerate(train_batch)])
        trainer.optimizer.load_state_dict(optimiser)
        costs.append((verify_s, timed.busy_seconds))
        rewards = train(trainer, task, tokenizer, train_batch)
        # How far training moved the adapter (B starts at 0: on a task the model never earns, it stays there).
        moved = max(float(np.abs(w).max()) for name, w in trainer.weights().items() if ".lora_B." in name)
        print(f"v{version}: reward {statistics.mean(rewards):.3f} (sd {statistics.pstdev(rewards):.3f}), "
              f"adapter's largest |B| after its step {moved:.4f}; verify {verify_s:.1f}s vs train step "
              f"{timed.busy_seconds:.1f}s on {len(train_batch)} samples", flush=True)

    result = summarize(records, lease_size, rule)
    ratio = statistics.median(v / t for v, t in costs) if costs else float("nan")
    print(f"\nverification / train step time on the same {args.train_seeds * args.group} samples, "
          f"median over {len(costs)} versions: {ratio:.3f}")
    print(json.dumps(dict(**result, verify_over_train_ratio=round(ratio, 3), temperature=args.temperature,
                          versions=args.versions, group=args.group, trainer_device=str(trainer.device),
                          nodes={kind: getattr(b, "hardware", "") for kind, b in nodes.backends.items()})))


if __name__ == "__main__":
    main()

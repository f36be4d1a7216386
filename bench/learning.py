"""Does the swarm learn as well per trained sample as a plain GRPO loop? Held-out accuracy of the
trained policy per version, the swarm against an in-process reference, over seeds, in one run.

- swarm: a coordinator and 2 real nodes (sequential pull) sharing the CPUs (bench/sync_modes.py's
  run), nodes on the shipped Q4_1 GGUF (or `--model`).
- reference: a plain GRPO loop in this process, written apart from the trainer so that what they
  share is only the task, the prompts and the scoring: the same base weights (the GGUF as the
  trainer dequantizes it), LoRA (rank, alpha, targets, init seed), AdamW, lr, group, token budget
  and training prompts (the swarm's seeds of each version); fp32 HF `generate` sampling at
  temperature 1 (no top-k / top-p); the objective's normalisation as `trainer/grpo.py` states it
  (token mean over the trained samples, biased group std, no clip, no KL), on-policy, so the
  ratio is 1 and there is nothing to correct.
Both make `--prompts` x `--group` samples a version, so a version holds the same trained samples
in both. Every `--eval-every` versions each side's adapter (the swarm's as its trainer saved it)
is evaluated the same way, on fp32 weights: the run's fixed held-out problems (its evaluation
seeds), greedy, scored by the run's scorer, generated in one batch (`Policy.accuracy`; the run's
own one-at-a-time evaluation took 2.5 min a version here).

    .venv/bin/python bench/learning.py [--task hard|demo] [--seeds 1 2 3] [--steps N] [--eval-every K]
        [--eval-prompts N] [--model FILE] [--swarm-run TOML] [--swarm-trainer TOML] [--plot FILE] [--keep DIR] [--quick]

Tasks: `hard` is two-digit addition (greedy held-out accuracy at version 0 is 0 %, 20 versions,
lr 2e-4); `demo` is `make demo`'s one-digit addition (10 versions, lr 3e-4). Prints a table (mean
and range over seeds per evaluated version) and ends with a JSON line: `parity_last` (the swarm's
mean held-out accuracy at the last version / the reference's), `parity_mean` (the same over the
mean of the versions after 0), `seed_spread` (the widest max - min over seeds at any evaluated
version after 0, either side), `task`, and every curve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TASKS = {  # name -> (task, params as TOML, versions, lr)
    "hard": ("arithmetic", "{ digits = 2 }", 20, 2e-4),
    "demo": ("arithmetic", "{ digits = 1 }", 10, 3e-4),
}
RANK, ALPHA = 16, 32.0


def training_seeds(seed: int, version: int, prompts: int) -> list[int]:
    """The episode seeds a sequential run leases at `version` (echo_coordinator.steps)."""
    base = seed * 1_000_003 + version * prompts
    return list(range(base, base + prompts))


def evaluated(args) -> list[int]:
    return sorted({0, *range(args.eval_every, args.steps, args.eval_every), args.steps})


class Policy:
    """A LoRA model of the base the trainer loads, that samples and scores batches of the task."""

    def __init__(self, args, seed: int):
        import torch
        from peft import LoraConfig, get_peft_model

        from echo_coordinator.trainer.learner import LORA_TARGETS
        from engines.episodes import Transcripts, context_window
        from engines.hf import load_model, load_tokenizer, turn_format
        from tasks import make_task

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        torch.manual_seed(seed)  # as the trainer seeds its LoRA init
        self.task, self.tokens = make_task(args.task_name, args.params), args.tokens
        self.tokenizer = load_tokenizer(Path(args.model))
        self.model = get_peft_model(load_model(Path(args.model), dtype=torch.float32),
                                    LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(LORA_TARGETS),
                                               lora_dropout=0.0, bias="none"))
        self.rules = Transcripts.of(self.tokenizer, turn_format(self.tokenizer), args.tokens,
                                    context_window(args.tokens, False))
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos

    def prompts(self, seeds: list[int]) -> list[tuple[int, ...]]:
        from engines.hf import prompt_ids

        return [prompt_ids(self.tokenizer, self.task.episode(s).messages) for s in seeds]

    def complete(self, prompts: list[tuple[int, ...]], greedy: bool) -> list[list[int]]:
        """One completion per prompt, generated together (left-padded): greedy, or sampled at
        temperature 1 from the whole distribution. Each ends at its EOS, which it includes."""
        import torch
        from transformers import GenerationConfig

        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts])
        attention = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        how = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        config = GenerationConfig(max_new_tokens=self.tokens, eos_token_id=self.eos, pad_token_id=self.pad, **how)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=attention, generation_config=config)
        return [row[: row.index(self.eos) + 1] if self.eos in row else row for row in out[:, width:].tolist()]

    def rewards(self, seeds: list[int], prompts, completions) -> list[float]:
        from engines.episodes import score
        from protocols.messages import RolloutSample

        return [score(self.task, RolloutSample(seed=s, prompt_ids=p, completion_ids=tuple(c), logprobs=()), self.rules)
                for s, p, c in zip(seeds, prompts, completions)]

    def accuracy(self, prompts: int) -> float:
        """Greedy held-out accuracy on the run's evaluation seeds (echo_coordinator.evaluation)."""
        from echo_coordinator.evaluation import eval_seeds

        seeds = list(eval_seeds(prompts))
        asked = self.prompts(seeds)
        return statistics.mean(self.rewards(seeds, asked, self.complete(asked, greedy=True)))


def swarm_run(args, seed: int, work: Path, name: str, mode: str = "sequential", staleness: int = 1,
              extra: str = "", trainer: str = "") -> list[dict]:
    """A swarm run of `args`' task and sizes in `work / name`, a trainer and 2 nodes sharing the
    CPUs (in sequential mode each waits while the other works): its steps' metrics records.
    `extra`: [run] lines; `trainer`: [trainer] lines (bench/sync_modes.run_mode). A run that
    finished there before (`--keep`) is not run again."""
    from echo_coordinator.plot import read_metrics
    from sync_modes import run_mode

    if (work / name / "metrics.jsonl").exists() and len(read_metrics(work / name)[0]) == args.steps:
        print(f"{name}: finished before, in {work / name}", flush=True)
        return read_metrics(work / name)[0]
    cpus = set(os.sched_getaffinity(0))
    run = SimpleNamespace(model=args.model, staleness=staleness, steps=args.steps, prompts=args.prompts,
                          group=args.group, nodes=2, eval_every=0, eval_prompts=args.eval_prompts,
                          task=args.task_name, task_params=args.task_params, seed=seed, lr=args.lr,
                          tokens=args.tokens, extra=extra, trainer=trainer)
    records, _ = run_mode(mode, run, work, cpus, cpus, name)
    return records


def adapters_accuracy(args, seed: int, data: Path) -> dict[int, float]:
    """Held-out accuracy of each evaluated version of the run in `data`: the adapters its
    trainer saved, evaluated by `Policy` as the reference's are."""
    from safetensors.numpy import load_file

    policy = Policy(args, seed)
    accuracy = {}
    for version in evaluated(args):
        if version:
            weights = as_peft(load_file(str(data / "adapters" / f"v{version}.safetensors")))
            loaded = policy.model.load_state_dict(weights, strict=False)
            if loaded.unexpected_keys:
                raise SystemExit(f"{data}: adapter tensors the model has no place for: {loaded.unexpected_keys[:3]}")
        accuracy[version] = policy.accuracy(args.eval_prompts)
        print(f"{data.name}: v{version} held-out {accuracy[version]:.3f}", flush=True)
    return accuracy


def swarm(args, seed: int, work: Path) -> dict[int, float]:
    """Held-out accuracy of each evaluated version of a sequential swarm run."""
    swarm_run(args, seed, work, f"swarm-seed{seed}", extra=args.swarm_run, trainer=args.swarm_trainer)
    return adapters_accuracy(args, seed, work / f"swarm-seed{seed}")


def as_peft(weights: dict) -> dict:
    """The trainer's adapter file's tensors under the names a fresh peft model gives them."""
    import torch

    return {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
            torch.from_numpy(v.copy()) for k, v in weights.items()}


def reference(args, seed: int, work: Path) -> dict[int, float]:
    """Held-out accuracy of each evaluated version of the plain loop (module docstring), kept in
    `work` (with `--keep`, a loop that finished there before is not run again)."""
    import numpy as np
    import torch

    kept = work / f"reference-seed{seed}.json"
    if kept.exists():
        print(f"reference-seed{seed}: finished before, in {kept}", flush=True)
        return {int(v): a for v, a in json.loads(kept.read_text()).items()}
    policy = Policy(args, seed)
    model = policy.model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    accuracy = {}
    for version in range(args.steps + 1):
        if version in evaluated(args):
            accuracy[version] = policy.accuracy(args.eval_prompts)
            print(f"reference-seed{seed}: v{version} held-out {accuracy[version]:.3f}", flush=True)
        if version == args.steps:
            break
        seeds = [s for s in training_seeds(seed, version, args.prompts) for _ in range(args.group)]
        prompts = policy.prompts(seeds)
        completions = policy.complete(prompts, greedy=False)
        rewards = np.array(policy.rewards(seeds, prompts, completions))
        groups = rewards.reshape(args.prompts, args.group)
        advantages = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)).reshape(-1)
        trained = [i for i, a in enumerate(advantages) if a != 0]
        if trained:
            model.train()
            optimizer.zero_grad()
            rows = [list(prompts[i]) + completions[i] for i in trained]
            length = max(map(len, rows))
            batch = torch.tensor([r + [policy.pad] * (length - len(r)) for r in rows])
            logprobs = torch.log_softmax(model(input_ids=batch).logits[:, :-1].float(), -1)
            chosen = logprobs.gather(-1, batch[:, 1:, None])[..., 0]  # (B, L-1): token t+1 given t
            mask = torch.zeros_like(chosen)
            for row, i in enumerate(trained):
                mask[row, len(prompts[i]) - 1 : len(prompts[i]) - 1 + len(completions[i])] = 1
            adv = torch.tensor(advantages[trained], dtype=torch.float32)[:, None]
            (-(adv * chosen * mask).sum() / mask.sum()).backward()
            optimizer.step()
        print(f"reference-seed{seed}: v{version + 1} reward {rewards.mean():.3f}, {len(trained)} trained", flush=True)
    kept.write_text(json.dumps(accuracy))
    return accuracy


def apart(loop, args, seed: int, work: Path) -> dict[int, float]:
    """`loop(args, seed, work)` in a process of its own, so that its memory (several GB of
    activations the allocator keeps) is the system's again before the swarm runs."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=loop, args=(args, seed, work))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"{loop.__name__} of seed {seed} failed (exit code {child.exitcode})")
    return {int(v): a for v, a in json.loads((work / f"reference-seed{seed}.json").read_text()).items()}


def summary(curves: dict[str, list[dict[int, float]]], versions: list[int]) -> dict:
    """Means over seeds per version, the parity ratios and the widest seed spread."""
    mean = {side: [statistics.mean(c[v] for c in runs) for v in versions] for side, runs in curves.items()}
    later = range(1, len(versions))
    spread = max(max(c[v] for c in runs) - min(c[v] for c in runs) for runs in curves.values() for v in versions[1:])

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b > 0 else None

    return dict(mean=mean, parity_last=ratio(mean["swarm"][-1], mean["reference"][-1]),
                parity_mean=ratio(statistics.mean(mean["swarm"][i] for i in later),
                                  statistics.mean(mean["reference"][i] for i in later)),
                seed_spread=round(spread, 3))


def resolve(args) -> None:
    """The task's parameters as a dict and the model's path, once the command line is read."""
    args.params = tomllib.loads(f"params = {args.task_params}")["params"]
    if not args.model:
        from echo_coordinator.main import demo_model_path

        args.model = str(demo_model_path())


def run_arguments(parser: argparse.ArgumentParser, task: str) -> None:
    """The options both benches take: the task, its sizes, the evaluation, the model and where runs go."""
    parser.add_argument("--task", choices=sorted(TASKS), default=task)
    parser.add_argument("--steps", type=int, default=0, help="versions to train (default: the task's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--model", default="", help="the nodes' GGUF (default: the shipped SmolLM2-135M Q4_1)")
    parser.add_argument("--plot", default="", help="write the curves to this PNG")
    parser.add_argument("--keep", default="", help="keep every run under this directory; runs that finished "
                        "there before are not run again")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_arguments(parser, "hard")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--swarm-run", default="", help="[run] lines added to the swarm's config (ablations)")
    parser.add_argument("--swarm-trainer", default="", help="[trainer] lines added to the swarm's config")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one seed, 4 versions of 2 x 4 samples of 8 tokens")
    args = parser.parse_args()
    args.task_name, args.task_params, steps, args.lr = TASKS[args.task]
    args.steps = args.steps or steps
    if args.quick:
        args.seeds, args.steps, args.prompts, args.group, args.eval_every, args.eval_prompts = [1], 4, 2, 4, 4, 4
        args.tokens = 8
    resolve(args)
    versions = evaluated(args)
    curves = {"swarm": [], "reference": []}
    with tempfile.TemporaryDirectory(prefix="echo-learning-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            curves["reference"].append(apart(reference, args, seed, work))
            curves["swarm"].append(swarm(args, seed, work))
    out = summary(curves, versions)
    samples = [v * args.prompts * args.group for v in versions]
    print(f"\nheld-out accuracy ({args.task}: {args.task_name} {args.task_params}, greedy, {args.eval_prompts} "
          f"prompts), mean [min, max] over seeds {args.seeds}")
    print(f"{'version':>8}{'samples':>9}" + "".join(f"{side:>24}" for side in curves))
    for i, (v, n) in enumerate(zip(versions, samples)):
        cells = [f"{out['mean'][side][i]:.3f} [{min(c[v] for c in runs):.3f}, {max(c[v] for c in runs):.3f}]"
                 for side, runs in curves.items()]
        print(f"{v:>8}{n:>9}" + "".join(f"{c:>24}" for c in cells))
    print(f"parity (swarm / reference): last {out['parity_last']}, mean over versions {out['parity_mean']}; "
          f"seed spread {out['seed_spread']}")
    if args.plot:
        from echo_coordinator.plot import plot_seeds

        png = plot_seeds({side: [dict(samples=samples, accuracy=[c[v] for v in versions]) for c in runs]
                          for side, runs in curves.items()}, Path(args.plot),
                         f"{args.task_name} {args.task_params}: swarm vs plain GRPO loop")
        print(f"curves: {png}")
    print(json.dumps(dict(parity_last=out["parity_last"], parity_mean=out["parity_mean"], seed_spread=out["seed_spread"],
                          task=f"{args.task_name} {args.task_params}", seeds=args.seeds, versions=versions,
                          samples_per_version=args.prompts * args.group, eval_prompts=args.eval_prompts,
                          swarm_run=args.swarm_run, swarm_trainer=args.swarm_trainer, model=Path(args.model).name,
                          curves={side: [[c[v] for v in versions] for c in runs] for side, runs in curves.items()})))


if __name__ == "__main__":
    main()

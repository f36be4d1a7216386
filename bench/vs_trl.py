"""Echo swarm against TRL's GRPOTrainer: the same model, task, group size, sample budget and
objective, held-out accuracy of the trained policy against wall time, in one run.

- TRL: `trl.GRPOTrainer` co-located on this machine (HF `generate` on the CPU, then the update),
  LoRA r=16 on every projection, lr 3e-4, loss "dapo" (token mean over the batch, as ours), no KL
  term, one optimiser step per batch of `--prompts` x `--group` completions; run twice, gradient
  checkpointing off and on. TRL is installed for this bench only, into .bench-trl/.
- Echo: a coordinator and 2 nodes (async, S = 4) on the same machine, the trainer pinned to CPU 0
  and the nodes to CPU 1 (bench/sync_modes.py's run), the same LoRA, lr and batch.
Both start from SmolLM2-135M-Instruct as the shipped Q4_1 GGUF dequantizes (TRL gets it saved
as an HF checkpoint). Every `--eval-every` steps each run's adapter is evaluated the same way,
afterwards, on the trainer's fp32 weights: `--eval-prompts` held-out problems, greedy
(echo_coordinator.local_eval). Wall time counts from the first step's start (model loading and
start-up excluded on both sides) to the end of the step that made the version.

    .venv/bin/python bench/vs_trl.py [--steps 16] [--prompts 8] [--group 8] [--eval-every 4] [--eval-prompts 32]

Ends with a JSON line: `wall_ratio_echo_over_trl` (seconds to the target accuracy, Echo / TRL
with gradient checkpointing off; goal <= 0.5), the same against TRL with it on, the target (the
best accuracy all three runs reach), and each run's curve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
TRL_DIR = ROOT / ".bench-trl"
TRL_VERSION = "1.16.0"
LR, RANK, ALPHA = 3e-4, 16, 32.0


def install_trl() -> None:
    """TRL and nothing else into .bench-trl/ (its other needs are already in the venv)."""
    if not (TRL_DIR / "trl").is_dir():
        print(f"installing trl=={TRL_VERSION} into {TRL_DIR} (this bench only) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_DIR),
                        f"trl=={TRL_VERSION}"], check=True)


def trl_run(out: Path, steps: int, prompts: int, group: int, eval_every: int, checkpointing: bool) -> None:
    """In a child process: train with TRL, saving the adapter and the wall time every eval_every steps."""
    sys.path.insert(0, str(TRL_DIR))
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from echo_coordinator.trainer.learner import LORA_TARGETS
    from node_quant import hf_checkpoint
    from tasks import make_task

    torch.set_num_threads(os.cpu_count() or 1)
    task = make_task("arithmetic", {"digits": 1})
    checkpoint = hf_checkpoint(out / "smollm2-hf")
    seeds = [1 * 1_000_003 + i for i in range(steps * prompts)]  # training prompts, never the eval set
    data = Dataset.from_list([{"prompt": [{"role": r, "content": c} for r, c in task.episode(s).messages], "seed": s}
                              for s in seeds])

    def reward(prompts, completions, seed, **_):
        return [task.reward(task.generate(s), c[0]["content"] if isinstance(c, list) else c)
                for s, c in zip(seed, completions)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = {}

        def on_step_begin(self, args, state, control, **kw):
            self.times.setdefault("start", time.time())

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % eval_every == 0 or state.global_step == steps:
                self.times[state.global_step] = time.time()
                model.save_pretrained(out / f"step{state.global_step}")

    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, per_device_train_batch_size=prompts * group // 4, gradient_accumulation_steps=4,
        num_generations=group, max_completion_length=32, temperature=1.0, beta=0.0, loss_type="dapo",
        gradient_checkpointing=checkpointing, use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
        report_to=[], shuffle_dataset=False, seed=1, disable_dropout=True,
    )
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(checkpoint),
                          peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(LORA_TARGETS),
                                                 lora_dropout=0.0, bias="none"),
                          callbacks=[clock])
    trainer.train()
    (out / "times.json").write_text(json.dumps(clock.times))


def evaluate(adapter_files: dict[int, Path | None], prompts: int) -> dict[int, float]:
    """Greedy held-out accuracy of each adapter (None: the base model), the same way for every run."""
    from safetensors.numpy import load_file

    from echo_coordinator.config import RunConfig, TrainerConfig
    from echo_coordinator.main import demo_model_path
    from echo_coordinator.local_eval import _run
    from echo_coordinator.trainer.learner import Trainer
    from echo_coordinator.verify import lora_base
    from tasks import make_task

    trainer = Trainer(demo_model_path(), TrainerConfig(lora_rank=RANK, lora_alpha=ALPHA), 1.0)
    run = RunConfig(task="arithmetic", task_params={"digits": 1}, eval_sampling="greedy", eval_prompts=prompts)
    task = make_task("arithmetic", {"digits": 1})
    out = {}
    for step, path in sorted(adapter_files.items()):
        weights = lora_base(trainer.weights()) if path is None else load_file(str(path))
        weights = {k if k.startswith("base_model.") else f"base_model.model.{k}": v for k, v in weights.items()}
        with trainer.holding(weights):
            out[step] = _run(trainer, task, run, step, prompts, None)[0]["eval_accuracy"]
    return out


def seconds_to(times: dict[int, float], accuracy: dict[int, float], target: float) -> float | None:
    """Wall seconds until an evaluated step first reached `target`, interpolated between evaluations."""
    points = sorted((times[s], accuracy[s]) for s in accuracy)
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if a1 >= target > a0:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
        if a0 >= target:
            return t0
    return points[-1][0] if points and points[-1][1] >= target else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--trl-run", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_run:
        trl_run(args.trl_run, args.steps, args.prompts, args.group, args.eval_every, bool(args.checkpointing))
        return
    install_trl()
    from echo_coordinator.main import demo_model_path
    from sync_modes import run_mode

    evaluated = list(range(args.eval_every, args.steps, args.eval_every)) + [args.steps]
    curves = {}
    with tempfile.TemporaryDirectory(prefix="echo-vs-trl-") as tmp:
        work = Path(tmp)
        for checkpointing in (False, True):
            name = f"trl_gc_{'on' if checkpointing else 'off'}"
            out = work / name
            out.mkdir()
            print(f"{name}: training ...", flush=True)
            subprocess.run([sys.executable, __file__, "--trl-run", str(out), "--checkpointing", str(int(checkpointing)),
                            "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
                            "--eval-every", str(args.eval_every)], check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=open(out / "log", "w"),
                           stderr=subprocess.STDOUT)
            times = json.loads((out / "times.json").read_text())
            start = times.pop("start")
            curves[name] = dict(seconds={0: 0.0, **{int(s): t - start for s, t in times.items()}},
                                adapters={0: None, **{s: out / f"step{s}" / "adapter_model.safetensors" for s in evaluated}})
        print("echo: training ...", flush=True)
        swarm = SimpleNamespace(model=str(demo_model_path()), staleness=4, steps=args.steps, prompts=args.prompts,
                                group=args.group, nodes=2, eval_every=0, eval_prompts=args.eval_prompts)
        records, _ = run_mode("async", swarm, work, {0}, {1})
        start = records[0]["time"] - records[0]["step_seconds"]
        published = {r["version"] + 1: r["time"] - start for r in records}
        curves["echo"] = dict(seconds={0: 0.0, **{v: published[v] for v in evaluated}},
                              adapters={0: None, **{v: work / "async" / "adapters" / f"v{v}.safetensors" for v in evaluated}})
        for name, c in curves.items():
            print(f"{name}: evaluating {len(c['adapters'])} versions ...", flush=True)
            c["accuracy"] = evaluate(c["adapters"], args.eval_prompts)
            del c["adapters"]
    target = min(max(c["accuracy"].values()) for c in curves.values())
    reach = {name: seconds_to(c["seconds"], c["accuracy"], target) for name, c in curves.items()}
    print(f"\n{'run':<12}" + "".join(f"{'step ' + str(s):>14}" for s in [0, *evaluated]) + f"{'to target':>12}")
    for name, c in curves.items():
        print(f"{name:<12}" + "".join(f"{c['accuracy'][s]:>7.3f} {c['seconds'][s]:>5.0f}s" for s in [0, *evaluated])
              + (f"{reach[name]:>11.0f}s" if reach[name] is not None else f"{'-':>12}"))

    def ratio(other: str) -> float | None:
        return round(reach["echo"] / reach[other], 3) if reach["echo"] and reach[other] else None

    print(json.dumps(dict(wall_ratio_echo_over_trl=ratio("trl_gc_off"), wall_ratio_echo_over_trl_gc_on=ratio("trl_gc_on"),
                          target=target, seconds_to_target=reach,
                          curves={n: dict(accuracy=c["accuracy"], seconds={k: round(v, 1) for k, v in c["seconds"].items()})
                                  for n, c in curves.items()},
                          steps=args.steps, samples_per_step=args.prompts * args.group, eval_prompts=args.eval_prompts)))


if __name__ == "__main__":
    main()

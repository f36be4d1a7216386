"""`echo-coordinator eval`: re-run a run's held-out evaluation on demand, on this machine.

The trainer's own weights of version V (the LoRA adapter the run saved for it, or in full mode
the checkpoint, which holds the latest version only), the run's evaluation seeds and sampling,
the same Gumbel-max sampler the nodes use (greedy: no noise) and the same replay scoring. The
swarm's numbers come from quantized nodes, these from the full-precision trainer, so the two
differ only where quantization flips a token (docs/protocols.md)."""

from __future__ import annotations

import json
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from echo_coordinator.config import RunConfig, TrainerConfig
from echo_coordinator.evaluation import SAMPLINGS, eval_seeds
from echo_coordinator.rewards import Transcripts, score
from protocols.errors import EchoError
from protocols.messages import RolloutSample
from protocols.sampling import sample_seed


def read_config(data_dir: Path) -> tuple[RunConfig, TrainerConfig]:
    path = Path(data_dir) / "config.json"
    if not path.exists():
        raise EchoError(f"no run configuration in {data_dir} (missing config.json; runs started before "
                        f"evaluation existed do not have one)")
    raw = json.loads(path.read_text())
    known = {f.name for f in fields(RunConfig)}, {f.name for f in fields(TrainerConfig)}
    return (RunConfig(**{k: v for k, v in raw["run"].items() if k in known[0]}),
            TrainerConfig(**{k: v for k, v in raw["trainer"].items() if k in known[1]}))


def weights_of(data_dir: Path, run: RunConfig, trainer, version: int) -> dict[str, np.ndarray]:
    """What the trainer held at `version`, from the run directory."""
    from safetensors.numpy import load_file

    from echo_coordinator.verify import lora_base

    if run.update == "lora":
        if version == 0:
            return lora_base(trainer.weights())
        path = data_dir / "adapters" / f"v{version}.safetensors"
        if not path.exists():
            have = sorted(int(p.stem[1:]) for p in (data_dir / "adapters").glob("v*.safetensors"))
            raise EchoError(f"no adapter of version {version} in {data_dir}; versions saved: {[0] + have}")
        return load_file(str(path))
    state = json.loads((data_dir / "state.json").read_text()) if (data_dir / "state.json").exists() else {}
    if version != state.get("version"):
        raise EchoError(f"a full-mode run keeps only its latest version ({state.get('version')}); "
                        f"version {version} cannot be evaluated")
    if not state.get("checkpoint"):
        return trainer.weights()  # version 0: the base model
    return load_file(str(data_dir / state["checkpoint"] / "weights.safetensors"))


def evaluate(data_dir: Path, version: int, prompts: int | None = None, progress=None) -> list[dict]:
    """Held-out accuracy of `version`, one record per sampling (the same keys as metrics.jsonl's)."""
    from echo_coordinator.base_model import recorded_source
    from echo_coordinator.trainer import Trainer
    from tasks import TaskError, make_task

    data_dir = Path(data_dir)
    run, tcfg = read_config(data_dir)
    try:
        task = make_task(run.task, run.eval_task_params or run.task_params)
    except TaskError as e:
        raise EchoError(str(e)) from None
    trainer = Trainer(recorded_source(data_dir), tcfg, run.temperature, run.seed, run.update)
    with trainer.holding(weights_of(data_dir, run, trainer, version)):
        return _run(trainer, task, run, version, prompts, progress)


def _run(trainer, task, run: RunConfig, version: int, prompts: int | None, progress) -> list[dict]:
    from echo_coordinator.trainer import prompt_ids, turn_format
    from echo_node.episodes import play
    from echo_node.transformers_backend import TransformersBackend

    tokenizer = trainer.tokenizer
    rules = Transcripts.of(tokenizer, turn_format(tokenizer), run.max_new_tokens)
    backend = TransformersBackend.of_model(trainer.model, tokenizer)
    seeds = eval_seeds(prompts or run.eval_prompts)
    records = []
    for sampling in SAMPLINGS[run.eval_sampling]:
        started, scores, tokens = time.time(), [], 0
        per_prompt = 1 if sampling == "greedy" else run.eval_samples
        for i, seed in enumerate(seeds):
            prompt = prompt_ids(tokenizer, task.episode(seed).messages)
            for j in range(per_prompt):
                noise = None if sampling == "greedy" else sample_seed(f"eval-v{version}", seed, j)
                if task.max_turns > 1:
                    sample = play(backend, task.episode(seed), seed, prompt, rules.turns, task.max_turns,
                                  run.max_new_tokens, run.temperature, noise)
                else:
                    out = backend.generate(list(prompt), run.max_new_tokens, run.temperature, noise)
                    sample = RolloutSample(seed, prompt, out.token_ids, out.logprobs)
                scores.append(score(task, sample, rules))
                tokens += sum(sample.loss_mask)
            if progress:
                progress(sampling, i + 1, len(seeds))
        records.append(dict(eval_version=version, eval_sampling=sampling, eval_accuracy=float(np.mean(scores)),
                            eval_samples=len(scores), eval_prompts=len(seeds), eval_complete=True, eval_tokens=tokens,
                            eval_seconds=time.time() - started, time=time.time(), eval_source="trainer"))
    return records

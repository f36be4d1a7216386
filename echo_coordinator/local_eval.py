"""`echo-coordinator eval`: re-run a run's held-out evaluation on demand, on this machine.

The trainer's own weights of version V (the LoRA adapter the run saved for it, or in full mode
the checkpoint, which holds the latest version only), the run's evaluation seeds and sampling,
the same Gumbel-max sampler the nodes use (greedy: no noise) and the same replay scoring. The
swarm's numbers come from quantized nodes, these from the full-precision trainer, so the two
differ only where quantization flips a token (docs/protocols.md)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from echo_coordinator.config import RunConfig
from echo_coordinator.evaluation import SAMPLINGS, eval_seeds
from echo_coordinator.run_dir import RunDir
from engines.episodes import Transcripts, context_window, rollouts, score
from protocols.errors import EchoError
from protocols.sampling import sample_seed


def weights_of(run_dir: RunDir, run: RunConfig, trainer, version: int) -> dict[str, np.ndarray]:
    """What the trainer held at `version`, from the run directory."""
    from safetensors.numpy import load_file

    from echo_coordinator.verify import lora_base

    if run.update == "lora":
        if version == 0:
            return lora_base(trainer.weights())
        path = run_dir.adapter(version)
        if not path.exists():
            raise EchoError(f"no adapter of version {version} in {run_dir.root}; "
                            f"versions saved: {[0] + run_dir.adapter_versions()}")
        return load_file(str(path))
    state = run_dir.load_state()
    latest = state.version if state else None
    if version != latest:
        raise EchoError(f"a full-mode run keeps only its latest version ({latest}); "
                        f"version {version} cannot be evaluated")
    if state.checkpoint is None:
        return trainer.weights()  # version 0: the base model
    return run_dir.weights_of(state.checkpoint)


def evaluate(data_dir: Path, version: int, prompts: int | None = None, progress=None) -> list[dict]:
    """Held-out accuracy of `version`, one record per sampling (the same keys as metrics.jsonl's)."""
    from echo_coordinator.trainer.learner import Trainer
    from tasks import TaskError, make_task

    run_dir = RunDir(data_dir)
    run, tcfg = run_dir.read_config()
    try:
        task = make_task(run.task, run.eval_task_params or run.task_params)
    except TaskError as e:
        raise EchoError(str(e)) from None
    trainer = Trainer(run_dir.base_source(), tcfg, run.temperature, run.seed, run.update)
    with trainer.holding(weights_of(run_dir, run, trainer, version)):
        return _run(trainer, task, run, version, prompts, progress)


def _run(trainer, task, run: RunConfig, version: int, prompts: int | None, progress) -> list[dict]:
    from engines.hf import prompt_ids, turn_format
    from engines.transformers_backend import TransformersBackend

    tokenizer = trainer.tokenizer
    window = context_window(run.max_new_tokens, task.max_turns > 1)
    rules = Transcripts.of(tokenizer, turn_format(tokenizer), run.max_new_tokens, window)
    backend = TransformersBackend.of_model(trainer.model, tokenizer, window)
    seeds = eval_seeds(prompts or run.eval_prompts)
    records = []
    for sampling in SAMPLINGS[run.eval_sampling]:
        started, scores, tokens = time.time(), [], 0
        per_prompt = 1 if sampling == "greedy" else run.eval_samples
        for i, seed in enumerate(seeds):
            prompt = prompt_ids(tokenizer, task.episode(seed).messages)
            items = [(seed, prompt, None if sampling == "greedy" else sample_seed(f"eval-v{version}", seed, j))
                     for j in range(per_prompt)]
            for sample in rollouts(backend, task, items, rules.turns, run.max_new_tokens, run.temperature):
                scores.append(score(task, sample, rules))
                tokens += sum(sample.loss_mask)
            if progress:
                progress(sampling, i + 1, len(seeds))
        records.append(dict(eval_version=version, eval_sampling=sampling, eval_accuracy=float(np.mean(scores)),
                            eval_samples=len(scores), eval_prompts=len(seeds), eval_complete=True, eval_tokens=tokens,
                            eval_seconds=time.time() - started, time=time.time(), eval_source="trainer"))
    return records

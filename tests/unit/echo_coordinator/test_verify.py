"""Sampling verification with a real trainer (torch) against a real llama.cpp node on a tiny model:
honest samples pass at every version they were made with; each way of writing tokens fails."""

import dataclasses

import numpy as np
import pytest

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.samples import TrainSample
from engines.hf import prompt_ids
from echo_coordinator.verify import Verifier, lora_base
from protocols.sampling import sample_seeds
from engines.backend import generate_one
from engines.gguf_io import write_lora_adapter
from engines.llama_backend import LlamaBackend
from protocols.errors import VerificationError
from protocols.messages import RolloutSample
from protocols.sampling import SamplingRule
from tasks import make_task
from tests.support.tiny_model import build_tiny_gguf

T = 0.7
LEASE = "abc-1"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")
    trainer = Trainer(path, TrainerConfig(lora_rank=4, lora_init="random", threads=1), temperature=T)
    backend = LlamaBackend(path, threads=1, n_ctx=256)
    task = make_task("arithmetic")
    prompts = {seed: tuple(prompt_ids(trainer.tokenizer, task.generate(seed).messages)) for seed in (3, 4)}
    adapter = tmp_path_factory.mktemp("a") / "v1.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, adapter, backend.layout)
    verifier = Verifier(trainer.evidence, SamplingRule(), keep_versions=4)
    verifier.remember(0, lora_base(trainer.weights()))
    verifier.remember(1, trainer.weights())
    return trainer, backend, prompts, adapter, verifier


def generate(backend, prompts, group=3, temperature=T, tokens=12) -> list[RolloutSample]:
    """What an honest node sends for lease LEASE: G samples per seed, each with its own noise."""
    samples = []
    for seed, prompt in prompts.items():
        for j in range(group):
            s = RolloutSample(seed, prompt, (0,), (0.0,))
            noise_seed = sample_seeds(LEASE, [x.seed for x in [*samples, s]])[-1]
            out = generate_one(backend, prompt, tokens, temperature, noise_seed)
            samples.append(RolloutSample(seed, prompt, out.token_ids, out.logprobs))
    return samples


def test_honest_samples_pass_at_the_version_they_were_made_with(setup):
    trainer, backend, prompts, adapter, verifier = setup
    before = trainer.weights()
    backend.set_adapter(None)
    base = generate(backend, prompts)
    evidence = verifier.check(LEASE, 0, base)
    backend.set_adapter(adapter)
    adapted = generate(backend, prompts)
    evidence += verifier.check(LEASE, 1, adapted)
    # fp32 weights on both sides: every token is the trainer's own choice, logprobs agree closely.
    assert all(e.flips == 0 and e.max_logprob_error < 1e-3 for e in evidence)
    assert [s.completion_ids for s in base] != [s.completion_ids for s in adapted]
    # Claiming the other version fails: the version is part of what is checked.
    with pytest.raises(VerificationError):
        verifier.check(LEASE, 1, base)
    with pytest.raises(VerificationError, match="no weights of version 7") as e:
        verifier.check(LEASE, 7, adapted)
    assert e.value.code == "unverifiable"
    after = trainer.weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # the trainer's own weights are back


def cheat(samples, index, **changes):
    return [dataclasses.replace(s, **changes) if i == index else s for i, s in enumerate(samples)]


def test_every_way_of_writing_tokens_is_caught(setup):
    trainer, backend, prompts, adapter, verifier = setup
    backend.set_adapter(adapter)
    honest = generate(backend, prompts)
    verifier.check(LEASE, 1, honest)
    s = honest[1]
    gold = tuple(trainer.tokenizer(" 42", add_special_tokens=False).input_ids) + (backend.eos,)
    teacher = trainer.logprobs([TrainSample(s.prompt_ids, gold, (0.0,) * len(gold), (1,) * len(gold), 0.0, 0)])[0]
    cases = {
        "gold answer, made-up logprobs": cheat(honest, 1, completion_ids=gold, logprobs=(-0.01,) * len(gold)),
        "gold answer, teacher-forced logprobs": cheat(honest, 1, completion_ids=gold, logprobs=tuple(teacher.tolist())),
        "honest text plus a written ending": cheat(honest, 1, completion_ids=s.completion_ids[:-2] + gold,
                                                   logprobs=s.logprobs[:-2] + (-0.5,) * len(gold)),
        "honest tokens, logprobs shaded down": cheat(honest, 1, logprobs=tuple(x - 1.0 for x in s.logprobs)),
        "one sample copied to the whole group": [honest[0]] * 3 + honest[3:],
    }
    caught = {}
    for name, samples in cases.items():
        with pytest.raises(VerificationError) as e:
            verifier.check(LEASE, 1, samples)
        caught[name] = e.value.code
    assert caught["honest tokens, logprobs shaded down"] == "bad_logprobs"
    assert caught["gold answer, teacher-forced logprobs"] == "bad_sampling"

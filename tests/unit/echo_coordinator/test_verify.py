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


def test_full_mode_quantized_nodes_are_checked_against_their_requantized_weights(tmp_path):
    """A full-mode node on a q4_k_m base re-exports each version and requantizes it; what it then
    samples with is that requantization, which `NodesHold` gives the verifier. The float master
    weights (what it was checked against before) refuse the same honest batch. A transformers
    node loads the same requantization, so one check fits both."""
    import functools

    from echo_coordinator.verify import NodesHold
    from engines.full_weights import file_type, requantized
    from engines.gguf_io import quantize
    from engines.transformers_backend import TransformersBackend

    # Peaked distributions (init_std 0.2), so a change of weights shows in the samples. Rows of 64
    # columns are too narrow for k-quants: llama.cpp stores them as q5_0 and q8_0.
    base = quantize(build_tiny_gguf(tmp_path / "f32.gguf", init_std=0.2), tmp_path / "q4_k_m.gguf", "q4_k_m")
    checker = Trainer(base, TrainerConfig(threads=1), temperature=T, update="full")
    node = LlamaBackend(base, threads=1, n_ctx=256)
    task = make_task("arithmetic")
    prompts = {seed: tuple(prompt_ids(checker.tokenizer, task.generate(seed).messages)) for seed in (3, 4)}
    # Version 1: every weight moved by 0.01, about what a few full-mode steps at lr 1e-3 do. In a
    # GGUF run the nodes' master weights are the publisher's view.
    _, master = node.base_weights()
    rng = np.random.default_rng(0)
    view = {k: (v + rng.choice([-0.01, 0.01], v.shape)).astype(np.float32) for k, v in master.items()}
    nodes_hold = NodesHold(functools.partial(requantized, checker.causal.config, tokenizer_from=base,
                                             out=tmp_path / "held.gguf", ftype=file_type(base)))
    held = nodes_hold(view)
    assert not (tmp_path / "held.gguf").exists()  # read back and removed
    assert all(np.array_equal(held[k], view[k]) for k in view if view[k].ndim == 1)  # norms stay f32
    assert not np.array_equal(held["model.layers.0.mlp.down_proj.weight"], view["model.layers.0.mlp.down_proj.weight"])
    verifier = Verifier(checker.evidence, SamplingRule(), keep_versions=4)
    verifier.remember(1, held)

    node.load_weights(view, 1, tmp_path / "llama")
    honest = generate(node, prompts, group=4)
    evidence = verifier.check(LEASE, 1, honest)
    assert np.mean([e.mean_logprob_error for e in evidence]) < 0.1
    with pytest.raises(VerificationError, match="version 1"):
        verifier.check(LEASE, 1, honest, weights=view)

    gpu_node = TransformersBackend(base, threads=1, n_ctx=256)
    gpu_node.load_weights(view, 1, tmp_path / "transformers")
    assert not any((tmp_path / "transformers").iterdir())
    state = gpu_node.model.state_dict()
    assert all(np.array_equal(state[k].numpy(), held[k]) for k in held)
    evidence = verifier.check(LEASE, 1, generate(gpu_node, prompts, group=4))
    assert all(e.max_logprob_error < 1e-3 for e in evidence)  # fp32 on both sides: the same weights

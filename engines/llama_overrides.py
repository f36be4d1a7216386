"""Keeping a mixture of experts' expert tensors in system RAM, the rest where llama.cpp puts it
(`--cpu-moe` / `--n-cpu-moe N` in llama.cpp's own tools): the one large model a consumer machine
can serve, Qwen3-30B-A3B, fits an 8 GB GPU this way, its experts (most of its bytes, few used per
token) read from RAM.

llama.cpp does it with tensor buffer-type overrides: a NULL-terminated array of (regex over
tensor names, buffer type) in `llama_model_params.tensor_buft_overrides`. llama-cpp-python 0.3.36
declares that field as an unused pointer and takes no option for it, so the array is built here
with ctypes and set on the parameters `Llama()` asks `llama_model_default_params` for, while it
loads. The array must outlive the load: the caller keeps it.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as llama_c  # Llama() calls this module's llama_model_default_params

EXPERTS = r"ffn_(up|down|gate)_exps"  # the tensors llama.cpp's --cpu-moe matches


class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def expert_patterns(layers: int | None) -> list[str]:
    """Patterns for the experts of every layer (None) or of the first `layers`."""
    if layers is None:
        return [rf"\.{EXPERTS}"]
    return [rf"^blk\.{i}\.{EXPERTS}" for i in range(layers)]


def cpu_overrides(patterns: list[str]) -> ctypes.Array:
    """The override array that puts tensors matching `patterns` in CPU (host) buffers."""
    ggml_base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml_base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    cpu = ggml_base.ggml_backend_cpu_buffer_type()
    array = (Override * (len(patterns) + 1))()  # the last entry stays NULL: the terminator
    for entry, pattern in zip(array, patterns):
        entry.pattern, entry.buft = pattern.encode(), cpu
    return array


@contextlib.contextmanager
def loading_with(overrides: ctypes.Array | None):
    """While a `Llama` loads in this block, its model parameters carry `overrides`."""
    if overrides is None:
        yield
        return
    original = llama_c.llama_model_default_params

    def params():
        p = original()
        p.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        return p

    llama_c.llama_model_default_params = params
    try:
        yield
    finally:
        llama_c.llama_model_default_params = original

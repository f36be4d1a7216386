"""Where llama.cpp runs a node's layers, and the context settings a node uses there.

A node's logprobs must match the trainer's (docs/verification.md). On the CPU that means an fp32
KV cache and no flash attention. GPU backends round batched attention to fp16 or TF32 whatever the
cache holds, so there the node first tries what their kernels are built for, an fp16 cache with
flash attention, and an fp32 cache after it (`candidates`). Each candidate is tried in a throwaway
process first (`engines.llama_probe`): a CUDA build died by segfault at its first call with an fp32
cache (issue 35; the cause was not found). The volunteer can name the cache type (`--kv`) instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from protocols.errors import EchoError

KV_TYPES = {"f32": 0, "f16": 1}  # ggml types
DEVICE_GPU, DEVICE_IGPU = 1, 2  # ggml_backend_dev_type: CPU 0, GPU 1, integrated GPU 2, accelerator 3


class DeviceError(EchoError):
    """llama.cpp cannot run the model on this machine's GPU with any setting the node may use."""


@dataclass(frozen=True)
class ContextSettings:
    kv: str = "f32"  # the KV cache's type, a key of KV_TYPES
    flash_attn: bool = False

    def __str__(self) -> str:
        return f"{self.kv} KV" + (" + flash attention" if self.flash_attn else "")


CPU_SETTINGS = ContextSettings()  # llama.cpp's CPU flash attention rounds through fp16 (~2e-4 nat)


def candidates(offloaded: bool, kv: str | None = None) -> list[ContextSettings]:
    """The settings to try, in order. On the CPU there is one, the fp32 cache (an fp16 cache adds
    ~2e-2 logit error there). On a GPU backend an fp16 cache with flash attention first, then the
    fp32 cache: in llama.cpp 0c1e57098 (llama-cpp-python 0.3.36) batched attention on an fp32
    cache runs in TF32 on CUDA (cuBLAS handles are made TF32, `ggml-cuda/common.cuh`; its fp32
    mat-mat kernel past 3 tokens too) and on fp16 inputs in Vulkan's and Metal's mat-mat kernels
    past 8 columns. There an fp32 cache buys no closer match, and costs twice the memory plus the
    attention scores flash attention never holds (n_ctx x 512 x heads floats). Flash attention on
    an fp32 cache is cast to fp16 by llama.cpp, so that pair is never tried. Honest fp16 nodes on
    Vulkan were calibrated like the fp32 ones (docs/verification.md). `kv` (`--kv`) fixes the type."""
    if kv is not None and kv not in KV_TYPES:
        raise ValueError(f"--kv must be one of {', '.join(KV_TYPES)}, got {kv!r}")
    if not offloaded:
        return [ContextSettings(kv or "f32", False)]
    options = [ContextSettings("f16", True), ContextSettings("f32", False)]
    return [s for s in options if kv is None or s.kv == kv]


@dataclass(frozen=True)
class Device:
    name: str  # llama.cpp's: CUDA0, Vulkan0, MTL0
    backend: str  # its backend's: CUDA, Vulkan, Metal
    description: str  # the hardware: "NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"
    free_bytes: int
    total_bytes: int

    def __str__(self) -> str:
        return f"{self.backend} {self.description} ({self.total_bytes / 2**30:.0f} GiB)"


def gpu_devices() -> list[Device]:
    """The GPU devices this llama.cpp build sees (none for a CPU-only build)."""
    from llama_cpp._ggml import libggml

    lib = _declare(libggml)
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) not in (DEVICE_GPU, DEVICE_IGPU):
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        backend = lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)).decode()
        found.append(Device(lib.ggml_backend_dev_name(dev).decode(), backend,
                            lib.ggml_backend_dev_description(dev).decode(), free.value, total.value))
    return found


@dataclass(frozen=True)
class ModelSizes:
    """What a model takes on a device, read from its GGUF (`model_sizes`)."""

    layer_bytes: int  # the largest layer's weights
    other_bytes: int  # weights outside the layers (embeddings, output head, final norm)
    n_layers: int
    kv_width: int  # K and V values a token stores per layer: 2 x KV heads x head size
    n_head: int
    vocab: int


def model_sizes(path) -> ModelSizes:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(key, default=None):
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else default

    layers: dict[int, int] = {}
    other = 0
    for t in reader.tensors:
        if t.name.startswith("blk."):
            index = int(t.name.split(".")[1])
            layers[index] = layers.get(index, 0) + int(t.n_bytes)
        else:
            other += int(t.n_bytes)
    n_head, n_embd = field("attention.head_count"), field("embedding_length")
    head = field("attention.key_length", n_embd // n_head)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelSizes(max(layers.values()), other, len(layers), 2 * field("attention.head_count_kv", n_head) * head,
                      n_head, vocab)


MIB = 2**20
RESERVE_BYTES = 256 * MIB  # llama.cpp's other buffers and the driver's own; measured slack, not exact
KV_BYTES = {"f32": 4, "f16": 2}
UBATCH = 512  # tokens a llama_decode step takes at most (engines.llama_batch.MAX_STEP_TOKENS)


def context_bytes(layers: int, n_ctx: int, kv_width: int, n_head: int, settings: ContextSettings) -> tuple[int, int]:
    """(KV cache, attention scores) bytes of `layers` layers over a context of `n_ctx` tokens:
    without flash attention the compute buffer holds n_ctx x 512 x heads float scores."""
    kv = layers * n_ctx * kv_width * KV_BYTES[settings.kv]
    return kv, 0 if settings.flash_attn else n_ctx * UBATCH * n_head * 4


def device_bytes(sizes: ModelSizes, layers: int, parallel: int, window: int, settings: ContextSettings) -> int:
    """An estimate of the device memory llama.cpp takes for `layers` offloaded layers (and the
    output head with them, once all are) and a context of `parallel` windows: weights, KV cache,
    the compute buffer (`context_bytes`), and the logits."""
    weights = layers * sizes.layer_bytes + (sizes.other_bytes if layers >= sizes.n_layers else 0)
    kv, scores = context_bytes(layers, parallel * window, sizes.kv_width, sizes.n_head, settings)
    logits = sizes.vocab * max(parallel, 1) * 4
    return weights + kv + (scores + logits + RESERVE_BYTES if layers else 0)


def fit(sizes: ModelSizes, budget: int, parallel: int, window: int, settings: ContextSettings) -> tuple[int, int]:
    """(layers to offload, sequences at once) within `budget` bytes of device memory. Every layer
    on the device matters more than a wide batch (a layer left on the CPU slows every token), so
    the batch is halved first, down to one sequence; only then are layers left on the CPU, at the
    batch asked for, down to 8 (the CPU's default: the CPU layers are the bottleneck then)."""
    p = parallel
    while p >= 1:
        if device_bytes(sizes, sizes.n_layers, p, window, settings) <= budget:
            return sizes.n_layers, p
        p //= 2
    p = min(parallel, 8)
    layers = sizes.n_layers - 1
    while layers > 0 and device_bytes(sizes, layers, p, window, settings) > budget:
        layers -= 1
    return layers, p


def within(sizes: ModelSizes, max_vram_gib: float, gpu_layers: int, parallel: int, window: int,
           settings: ContextSettings) -> tuple[int, int, str]:
    """`--max-vram` on a GPU with `settings`, for a model of `sizes`: (layers to offload, sequences
    at once, what was chosen, said for the volunteer)."""
    layers, parallel = fit(sizes, int(max_vram_gib * 2**30), parallel, window, settings)
    if gpu_layers >= 0:
        layers = min(layers, gpu_layers)
    estimate = device_bytes(sizes, layers, parallel, window, settings) / 2**30
    return layers, parallel, (f"--max-vram {max_vram_gib:g} GiB: {layers}/{sizes.n_layers} layers on the GPU, "
                              f"{parallel} sequences of {window} tokens with {settings} (about {estimate:.1f} GiB)")


def _declare(lib):
    """ggml's device API (llama-cpp-python does not wrap it), typed once."""
    if getattr(lib, "_echo_declared", False):
        return lib
    pointer = ctypes.c_void_p
    for name, result, args in [
        ("ggml_backend_dev_count", ctypes.c_size_t, []),
        ("ggml_backend_dev_get", pointer, [ctypes.c_size_t]),
        ("ggml_backend_dev_type", ctypes.c_int, [pointer]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [pointer]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [pointer]),
        ("ggml_backend_dev_memory", None, [pointer, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
        ("ggml_backend_dev_backend_reg", pointer, [pointer]),
        ("ggml_backend_reg_name", ctypes.c_char_p, [pointer]),
    ]:
        function = getattr(lib, name)
        function.restype, function.argtypes = result, args
    lib._echo_declared = True
    return lib

"""llama-cpp-python generation with behaviour logprobs (`engines.backend`), LoRA hot-swap without
a reload, and full-mode weights re-exported to GGUF.

`llama_cpp.Llama` loads the model and tokenizes; generation runs in a context of its own that
decodes `parallel` sequences at once (`engines.llama_batch`), sampled by `engines.sampler`, never
by llama.cpp's sampler. Its KV cache is fp32 (llama.cpp's default fp16 cache adds ~2e-2 logit
error on the CPU), unless a GPU backend runs only fp16 (`engines.llama_device`, tried by a probe).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import llama_cpp
import numpy as np

from engines import llama_batch, llama_device, llama_overrides, llama_probe
from engines.backend import DEFAULT_PARALLEL, Completion, Follow, Meter, Request, hardware_summary
from engines.full_weights import export_quantized, file_type
from engines.gguf_io import Layout
from engines.hf import load_config, load_master
from engines.sampler import use_threads

MIN_CONTEXT = 32  # the tokenizing context's window: it never decodes
MAX_PIECE_BYTES = 1024  # longest text of one token


class LlamaBackend:
    name = "llama_cpp"

    def __init__(self, model_path: Path, threads: int = 0, n_ctx: int = 2048, interrupt: threading.Event | None = None,
                 gpu_layers: int | None = None, parallel: int = DEFAULT_PARALLEL, cpu_moe: bool = False,
                 n_cpu_moe: int = 0, kv: str | None = None, max_vram_gib: float | None = None,
                 confine: Callable[[], object] | None = None):
        """`n_ctx`: each sequence's window, tokens. `parallel`: sequences decoded at once; the KV
        cache holds `parallel x n_ctx` tokens. `interrupt`: when set (the node stopping),
        generation stops at the next step. `gpu_layers`: layers to offload; None: all of them
        when llama.cpp was built with a GPU backend. `cpu_moe`: a mixture of experts' expert
        tensors stay in system RAM; `n_cpu_moe`: those of the first N layers (`llama_overrides`).
        `kv`: the KV cache's type (f32, f16); None: the first that works here (`llama_device`).
        `max_vram_gib`: the device memory the node may take; layers and `parallel` are fitted to it
        (`self.fitted` says what was chosen). `confine`: called once the settings are chosen, before
        llama.cpp opens the model (`engines.llama_worker` confines itself there; the probe
        processes started before it confine themselves)."""
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        self.gpu = bool(llama_cpp.llama_supports_gpu_offload())
        if gpu_layers is None:
            gpu_layers = -1 if self.gpu else 0
        # On a GPU, settings are tried in a throwaway process first: a crashing backend must not take the node.
        placed = llama_probe.place(Path(model_path), self.gpu, gpu_layers, parallel, n_ctx, kv, max_vram_gib,
                                   sandbox=confine is not None)
        self.settings, self.fitted = placed.settings, placed.fitted  # fitted: what --max-vram chose
        self.threads, self.n_ctx, self.gpu_layers, self.parallel = threads, n_ctx, placed.gpu_layers, placed.parallel
        self.offloaded = self.gpu and self.gpu_layers != 0
        patterns = llama_overrides.expert_patterns(None if cpu_moe else n_cpu_moe)  # [] for neither
        self._overrides = llama_overrides.cpu_overrides(patterns) if patterns else None  # read at every load
        use_threads(threads)
        self.file_type = file_type(model_path)  # the quant type to requantize to
        self.layout = Layout.of_file(Path(model_path))  # what a LoRA adapter for this model must match
        self.hardware = hardware_summary(self._placement(), threads) + f", {self.settings}"
        if patterns and self.layout.n_expert:
            n_layers = self.layout.n_layers
            self.hardware += f", experts in RAM ({'every layer' if cpu_moe else f'first {min(n_cpu_moe, n_layers)} of {n_layers} layers'})"
        if confine is not None:  # after reading /proc for `hardware`, before llama.cpp reads the model
            confine()
        self.batch: llama_batch.BatchContext | None = None
        self.interrupt = interrupt or threading.Event()
        self.llm = self._load(model_path)
        self.vocab_size = self.llm.n_vocab()
        self.n_params = int(llama_cpp.llama_model_n_params(self.llm.model))  # bounds what an adapter may declare
        self.eos = self.llm.token_eos()
        self.model_path = Path(model_path)
        self._adapter = None
        self.meter = Meter()

    def _placement(self) -> str | None:
        """Where the layers run, when not all on the CPU: `2/30 layers on CUDA NVIDIA H200 (139 GiB)`."""
        if not (self.gpu and self.gpu_layers):
            return None
        n_layers = self.layout.n_layers
        offloaded = n_layers if self.gpu_layers < 0 else min(self.gpu_layers, n_layers)
        devices = llama_device.gpu_devices()
        return f"{offloaded}/{n_layers} layers on {', '.join(map(str, devices)) or 'a GPU'}"

    def _load(self, path: Path) -> llama_cpp.Llama:
        """The model, and its generation context. The `Llama` object's own context only tokenizes."""
        with llama_overrides.loading_with(self._overrides):
            llm = llama_cpp.Llama(str(path), n_ctx=MIN_CONTEXT, verbose=False, n_gpu_layers=self.gpu_layers)
        batch = llama_batch.BatchContext(llm.model, self.parallel, self.n_ctx, self.threads, self.settings)
        if self.batch is not None:
            self.batch.close()
        self.batch = batch
        return llm

    def reload(self, path: Path) -> None:
        """Full mode: switch to re-exported weights. The old model serves until the new one loaded."""
        if self._adapter is not None:
            raise ValueError("a LoRA adapter is active; full-mode reloads do not combine with adapters")
        self.llm = self._load(path)

    def base_weights(self):
        return load_master(self.model_path)

    def load_weights(self, master: dict[str, np.ndarray], version: int, workdir: Path) -> None:
        """Re-export `master` (of `base_weights`' model) to `workdir/v{version}.gguf`, requantized to
        the joined file's type, and reload; older exports go."""
        workdir.mkdir(parents=True, exist_ok=True)
        out = workdir / f"v{version}.gguf"
        export_quantized(load_config(self.model_path), master, self.model_path, out, self.file_type)
        self.reload(out)
        for old in workdir.glob("v*.gguf"):
            if old != out:
                old.unlink()

    def generate(self, requests: list[Request], temperature: float, follow: Follow | None = None) -> list[Completion]:
        """`engines.backend.Backend.generate`: up to `parallel` sequences decoded together."""
        bounded = [self._bounded(r) for r in requests]

        def follow_bounded(index: int, done: Completion) -> Request | None:
            following = follow(index, done) if follow is not None else None
            return None if following is None else self._bounded(following)

        return llama_batch.generate(self.batch, bounded, temperature, self.eos, self.meter, self.interrupt,
                                    follow_bounded)

    def _bounded(self, request: Request) -> Request:
        """The request cut to the context window; a prompt that fills it is an error."""
        room = self.n_ctx - len(request.prompt_ids)
        if room < 1:
            raise ValueError(f"a prompt of {len(request.prompt_ids)} tokens leaves no room in the {self.n_ctx}-token window")
        return request if request.max_new_tokens <= room else replace(request, max_new_tokens=room)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of text written into a transcript; special-token text becomes the special token."""
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def detokenize(self, ids: tuple[int, ...]) -> str:
        """Text of token ids, special tokens written out, exactly as the trainer's tokenizer decodes
        them. (llama-cpp-python's own detokenize silently drops pieces longer than 32 bytes.)"""
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        buffer = ctypes.create_string_buffer(MAX_PIECE_BYTES)
        out = bytearray()
        for token in ids:
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, MAX_PIECE_BYTES, 0, True)
            if n < 0:
                raise ValueError(f"token {token} has a piece longer than {MAX_PIECE_BYTES} bytes")
            out += buffer.raw[:n]
        return out.decode("utf-8", errors="replace")

    @property
    def throughput(self) -> float:
        return self.meter.rate

    def set_adapter(self, path: Path | None) -> None:
        """Swap the active LoRA adapter (None: base model only). The new adapter is loaded
        before the old one is released, so a bad file leaves the old adapter active."""
        new = None
        if path is not None:
            new = llama_cpp.llama_adapter_lora_init(self.llm.model, str(path).encode())
            if not new:
                raise ValueError(f"llama.cpp could not load LoRA adapter {path}")
        if self.offloaded:
            # On a GPU backend each adapter goes into a fresh context: swapped in place on Vulkan,
            # the first decode after corrupted the heap (docs/verification.md). The old context
            # goes first (its KV cache is large).
            self.batch.close()
            try:
                self.batch = llama_batch.BatchContext(self.llm.model, self.parallel, self.n_ctx, self.threads,
                                                      self.settings)
            except llama_batch.DecodeError:
                if new is not None:
                    llama_cpp.llama_adapter_lora_free(new)
                raise  # (the same settings made a context at start; until one is made, decoding is refused)
        rc = self._attach(new)
        if rc != 0:
            if new is not None:
                llama_cpp.llama_adapter_lora_free(new)
            if self.offloaded:
                self._attach(self._adapter)  # the fresh context holds none yet
            raise ValueError(f"llama.cpp refused LoRA adapter {path} (rc={rc})")
        if self._adapter is not None:
            llama_cpp.llama_adapter_lora_free(self._adapter)
        self._adapter = new  # the batch context's cache is cleared at every generate

    def _attach(self, adapter) -> int:
        """Make `adapter` (None: none) the context's only one; llama.cpp's return code."""
        if adapter is None:
            return llama_cpp.llama_set_adapters_lora(self.batch.ctx, None, 0, None)
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)
        return llama_cpp.llama_set_adapters_lora(self.batch.ctx, adapters, 1, (ctypes.c_float * 1)(1.0))

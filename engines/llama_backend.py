"""llama-cpp-python generation with behaviour logprobs (`engines.backend`), LoRA hot-swap without
a reload, and full-mode weights re-exported to GGUF.

The loop drives `eval()` itself and reads each row from `scores` (logits_all=True); llama.cpp's
own sampler is not used. The KV cache is kept in fp32: llama.cpp's default fp16 cache adds ~2e-2
logit error, and only with an fp32 cache does reusing a prompt's cache for the G samples of a
group (6x faster on a 263-token prompt) give the same tokens as a cold start.
"""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import llama_cpp
import numpy as np

from engines.backend import Completion, Interrupted, Meter, hardware_summary
from engines.full_weights import export_quantized
from engines.gguf_io import Layout
from engines.hf import load_master
from protocols import sampling

GGML_TYPE_F32 = 0
MAX_PIECE_BYTES = 1024  # longest text of one token


class LlamaBackend:
    name = "llama_cpp"

    def __init__(self, model_path: Path, threads: int = 0, n_ctx: int = 2048, interrupt: threading.Event | None = None,
                 gpu_layers: int | None = None):
        """`interrupt`: when set (the node stopping), generation stops at the next token.
        `gpu_layers`: layers to offload; None: all of them when llama.cpp was built with a GPU backend."""
        self.gpu = bool(llama_cpp.llama_supports_gpu_offload())
        if gpu_layers is None:
            gpu_layers = -1 if self.gpu else 0
        self.threads, self.n_ctx, self.gpu_layers = threads, n_ctx, gpu_layers
        self.interrupt = interrupt or threading.Event()
        self.llm = self._load(model_path)
        meta = self.llm.metadata
        self.file_type = int(meta.get("general.file_type", 0))  # the quant type to requantize to
        self.layout = Layout.of_metadata(meta)  # what a LoRA adapter for this model must match
        n_layers = self.layout.n_layers
        offloaded = n_layers if gpu_layers < 0 else min(gpu_layers, n_layers)
        self.hardware = hardware_summary(f"GPU offload {offloaded}/{n_layers} layers" if self.gpu and gpu_layers else None,
                                         threads)
        self.vocab_size = self.llm.n_vocab()
        self.eos = self.llm.token_eos()
        self.model_path = Path(model_path)
        self.hf_config = None  # full mode: the base's HF config, read with the master weights (`base_weights`)
        self._adapter = None
        self.meter = Meter()

    def _load(self, path: Path) -> llama_cpp.Llama:
        kwargs = dict(n_threads=self.threads) if self.threads else {}
        return llama_cpp.Llama(str(path), logits_all=True, n_ctx=self.n_ctx, verbose=False, n_gpu_layers=self.gpu_layers,
                               type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, **kwargs)

    def reload(self, path: Path) -> None:
        """Full mode: switch to re-exported weights. The old model serves until the new one loaded."""
        if self._adapter is not None:
            raise ValueError("a LoRA adapter is active; full-mode reloads do not combine with adapters")
        self.llm = self._load(path)

    def base_weights(self):
        self.hf_config, master = load_master(self.model_path)
        return self.hf_config, master

    def load_weights(self, master: dict[str, np.ndarray], version: int, workdir: Path) -> None:
        """Re-export `master` (of `base_weights`' model) to `workdir/v{version}.gguf`, requantized to
        the joined file's type, and reload; older exports go."""
        workdir.mkdir(parents=True, exist_ok=True)
        out = workdir / f"v{version}.gguf"
        export_quantized(self.hf_config, master, self.model_path, out, self.file_type)
        self.reload(out)
        for old in workdir.glob("v*.gguf"):
            if old != out:
                old.unlink()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int | None,
                 offset: int = 0) -> Completion:
        """Sample up to `max_new_tokens` tokens after `prompt_ids` with the Gumbel noise of sample
        `seed` (None: greedy); `offset` is the completion position of the first one (later turns of an episode)."""
        started = time.perf_counter()
        limit = min(max_new_tokens, self.llm.n_ctx() - len(prompt_ids))
        self._prefill(prompt_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        while len(tokens) < limit:
            if self.interrupt.is_set():
                raise Interrupted("generation interrupted")
            row = self.llm.scores[self.llm.n_tokens - 1].astype(np.float64) / temperature  # (V,)
            token = sampling.choose(row, sampling.noise(seed, [offset + len(tokens)], len(row))[0])
            tokens.append(token)
            logprobs.append(float(sampling.log_softmax(row)[token]))
            if token == self.eos or len(tokens) == limit:
                break
            self.llm.eval([token])
        self.meter.add(len(tokens), started)
        return Completion(tuple(tokens), tuple(logprobs))

    def _prefill(self, prompt_ids: list[int]) -> None:
        """Evaluate the prompt, keeping the longest cached prefix (a group's samples share it);
        the last prompt token is always evaluated again so its logits row is fresh."""
        cached = 0
        for a, b in zip(self.llm.input_ids[: self.llm.n_tokens], prompt_ids[:-1]):
            if a != b:
                break
            cached += 1
        if cached == 0:
            self.llm.reset()
        self.llm.n_tokens = cached  # eval() drops the KV cache past n_tokens
        self.llm.eval(prompt_ids[cached:])

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
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(new)
            scales = (ctypes.c_float * 1)(1.0)
            rc = llama_cpp.llama_set_adapters_lora(self.llm.ctx, adapters, 1, scales)
        else:
            rc = llama_cpp.llama_set_adapters_lora(self.llm.ctx, None, 0, None)
        if rc != 0:
            if new is not None:
                llama_cpp.llama_adapter_lora_free(new)
            raise ValueError(f"llama.cpp refused LoRA adapter {path} (rc={rc})")
        if self._adapter is not None:
            llama_cpp.llama_adapter_lora_free(self._adapter)
        self._adapter = new
        self.llm.reset()  # the KV cache holds states computed under the old adapter

"""llama-cpp-python generation with behaviour logprobs, and LoRA hot-swap without a reload.

Logprobs are those of the distribution actually sampled from: plain temperature sampling (no
top-k / top-p / min-p / penalties), and log-softmax(logits / T) of the row that produced each
token. This uses `generate()` plus `scores` (logits_all=True), ~4x faster than
`create_completion(logprobs=k)` and equal to the HF logprobs to 1e-5 on fp32 models.
The KV cache is kept in fp32: llama.cpp's default fp16 cache adds ~2e-2 logit error, and only
with an fp32 cache does reusing a prompt's cache for the G samples of a group (6x faster on a
263-token prompt) give the same tokens as a cold start.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

# Every sampler stage other than temperature is disabled, so the sampling distribution is
# exactly softmax(logits / T) and the recorded logprobs are unbiased behaviour logprobs.
PURE_SAMPLING = dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                     frequency_penalty=0.0, presence_penalty=0.0)
GGML_TYPE_F32 = 0
MAX_PIECE_BYTES = 1024  # longest text of one token


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class LlamaBackend:
    name = "llama_cpp"

    def __init__(self, model_path: Path, threads: int = 0, n_ctx: int = 2048):
        self.threads, self.n_ctx = threads, n_ctx
        self.llm = self._load(model_path)
        meta = self.llm.metadata
        self.file_type = int(meta.get("general.file_type", 0))  # the quant type to requantize to
        self.n_layers = int(meta["llama.block_count"])
        self.n_head = int(meta["llama.attention.head_count"])
        self.n_head_kv = int(meta.get("llama.attention.head_count_kv", self.n_head))
        self.vocab_size = self.llm.n_vocab()
        self.eos = self.llm.token_eos()
        self._adapter = None
        self.tokens_generated = 0
        self.seconds_generating = 0.0

    def _load(self, path: Path) -> llama_cpp.Llama:
        kwargs = dict(n_threads=self.threads) if self.threads else {}
        return llama_cpp.Llama(str(path), logits_all=True, n_ctx=self.n_ctx, verbose=False,
                               type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, **kwargs)

    def reload(self, path: Path) -> None:
        """Full mode: switch to re-exported weights. The old model serves until the new one loaded."""
        if self._adapter is not None:
            raise ValueError("a LoRA adapter is active; full-mode reloads do not combine with adapters")
        self.llm = self._load(path)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Completion:
        started = time.perf_counter()
        self.llm.set_seed(seed)  # generate() reuses one seed per call: each sample needs its own
        tokens: list[int] = []
        limit = min(max_new_tokens, self.llm.n_ctx() - len(prompt_ids))
        # reset=True keeps the longest cached prefix of prompt_ids, so a group's samples share prefill.
        for token in self.llm.generate(prompt_ids, temp=temperature, reset=True, **PURE_SAMPLING):
            tokens.append(token)
            if token == self.eos or len(tokens) >= limit:
                break
        p = len(prompt_ids)
        rows = np.asarray(self.llm.scores[p - 1 : p - 1 + len(tokens)], dtype=np.float64) / temperature  # (T, V)
        rows -= rows.max(axis=1, keepdims=True)
        logprobs = rows[np.arange(len(tokens)), tokens] - np.log(np.exp(rows).sum(axis=1))
        self.tokens_generated += len(tokens)
        self.seconds_generating += time.perf_counter() - started
        return Completion(tuple(tokens), tuple(float(x) for x in logprobs))

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
        return self.tokens_generated / self.seconds_generating if self.seconds_generating else 0.0

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

"""What a node's generation backend is (`Backend`), and what every backend shares.

Both backends sample by verifiable Gumbel-max (`protocols.sampling`): token t is
argmax(logits_t / T + g_t) with noise fixed by the lease's sample seed, so the trainer can check
every token; the behaviour logprob is log-softmax(logits / T) of the row that produced it.
The node holds a `Backend` and never asks which one it is.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from protocols.errors import EchoError

DEFAULT_PARALLEL = 8  # sequences at once: 1.9x one-at-a-time on 2 CPU threads (SmolLM2-135M); 32 gives 2.2x


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Request:
    """One sequence to sample: after `prompt_ids`, up to `max_new_tokens` tokens with the Gumbel
    noise of sample `seed` (None: greedy), the first at completion position `offset` (a later
    turn of an episode counts the turns before it)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int | None
    offset: int = 0


# Called as a sequence's turn ends, with the index of the request it began as: its next request
# (a prompt that extends the last one with the completion) or None when it is done.
Follow = Callable[[int, Completion], "Request | None"]


class Interrupted(Exception):
    """The backend's `interrupt` was set while generating: the sample is dropped."""


class BackendCrashed(EchoError):
    """llama.cpp's worker process died (or broke its protocol) during a call, which failed; a
    worker as it was before has taken its place (`engines.llama_process`)."""


class Backend(Protocol):
    name: str  # announced, display only
    hardware: str  # announced: `hardware_summary`
    eos: int  # end-of-turn token id
    n_ctx: int  # context window, tokens
    vocab_size: int
    parallel: int  # sequences it decodes at once: announced, and leases are sized to fill it

    @property
    def throughput(self) -> float:
        """Tokens per second generated so far."""

    def generate(self, requests: list[Request], temperature: float, follow: Follow | None = None) -> list[Completion]:
        """Each request's completion (its last turn's when `follow` continued it), as many decoded
        at once as the backend can."""

    def tokenize(self, text: str) -> list[int]:
        """Token ids of text written into a transcript; special-token text becomes the special token."""

    def detokenize(self, ids: tuple[int, ...]) -> str:
        """Text of token ids, special tokens written out, exactly as the trainer's tokenizer decodes them."""

    def base_weights(self) -> tuple[object, dict[str, np.ndarray]]:
        """Full mode: (HF config, float32 master weights) of the base model, which updates apply to."""

    def set_adapter(self, path: Path | None) -> None:
        """LoRA mode: serve with this GGUF adapter (None: the base alone); a bad file changes nothing."""

    def load_weights(self, master: dict[str, np.ndarray], version: int, workdir: Path) -> None:
        """Full mode: serve `version`'s master weights from now on (`workdir`: room for its files)."""


def generate_one(backend: Backend, prompt_ids, max_new_tokens: int, temperature: float, seed: int | None) -> Completion:
    """One sequence alone (checks and benches that compare single samples)."""
    return backend.generate([Request(tuple(prompt_ids), max_new_tokens, seed)], temperature)[0]


class Meter:
    """Tokens generated and the time it took, for `throughput`."""

    def __init__(self):
        self.tokens = 0
        self.seconds = 0.0

    def add(self, tokens: int, started: float) -> None:
        self.tokens += tokens
        self.seconds += time.perf_counter() - started

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def hardware_summary(gpu: str | None, threads: int) -> str:
    """What a node runs on, for its announcement: `x86_64, 2 cores, 23 GiB RAM, CPU only`;
    `gpu`: where its layers run when not on the CPU."""
    import psutil

    cores = threads or os.cpu_count() or 1
    memory = psutil.virtual_memory().total / 2**30
    return f"{platform.machine()}, {cores} cores, {memory:.0f} GiB RAM, {gpu or 'CPU only'}"

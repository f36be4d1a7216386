"""Batched decoding on llama.cpp: every sequence of a lease in one context, one `llama_decode` a step.

- One context holds up to `parallel` sequences (`n_seq_max`) in a unified KV cache of
  `parallel x window` cells, so every sequence fits its whole window whatever the others hold.
- A prompt shared by several requests (the G samples of a group) is evaluated once: its tokens
  enter the batch once, tagged with every sequence id of the group, and its last row of logits
  serves all of them (each with its own noise). A request admitted later, into a slot another
  sequence freed, takes its prompt's cells from a live sibling (`llama_memory_seq_cp` tags them
  with its id, copying nothing) and evaluates only the prompt's last token, for its logits.
- A step feeds each live sequence its pending tokens (a prompt, a prompt's tail after a turn, or
  the token just sampled) and asks llama.cpp for logits only at each sequence's last one; the
  rows are sampled together (`engines.sampler`). A sequence that ends its turn is handed to
  `follow`, which may continue it (a multi-turn episode's next turn, whose prompt extends what the
  cache holds, so only the environment's reply is evaluated) or let it go, freeing its slot and
  cells for a request still queued. Sequences at different turns share steps.
- The KV cache is fp32 and flash attention off, unless the GPU backend needs otherwise
  (`engines.llama_device`). Batched kernels still round differently from single-stream ones
  (docs/verification.md measures what that changes).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import llama_cpp
import numpy as np
from llama_cpp._utils import suppress_stdout_stderr

from engines.backend import Completion, Follow, Interrupted, Meter, Request
from engines.llama_device import CPU_SETTINGS, KV_TYPES, ContextSettings
from engines.sampler import sample_rows

MAX_STEP_TOKENS = 512  # tokens one llama_decode call takes: prompts longer than this go in parts


class DecodeError(RuntimeError):
    """llama.cpp refused a batch (out of KV cells, or a backend failure)."""


@dataclass
class _Sequence:
    """One live sequence: the request it serves now and what the cache holds of it."""

    index: int  # of the request it began as: `follow` and the results use it
    slot: int  # llama.cpp sequence id
    request: Request
    cached: int = 0  # tokens the KV cache holds of it: the prompt, then the sampled tokens but the last
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def limit(self) -> int:
        return self.request.max_new_tokens

    def pending(self) -> list[int]:
        """Tokens to evaluate before this sequence can sample: the prompt's uncached part, or the
        token it sampled last."""
        return list(self.request.prompt_ids[self.cached:]) if not self.tokens else [self.tokens[-1]]


class BatchContext:
    """A llama.cpp context for `parallel` sequences of up to `window` tokens each, and its batch."""

    def __init__(self, model, parallel: int, window: int, threads: int, settings: ContextSettings = CPU_SETTINGS):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = parallel * window
        params.n_batch = params.n_ubatch = MAX_STEP_TOKENS
        params.n_seq_max = parallel
        params.kv_unified = True  # a shared prompt's cells belong to every sequence of its group
        params.type_k = params.type_v = KV_TYPES[settings.kv]
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.n_threads = params.n_threads_batch = threads or os.cpu_count() or 1
        params.embeddings = False
        with suppress_stdout_stderr(disable=False):  # llama.cpp's notes on context size, as `Llama(verbose=False)`
            self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise DecodeError(f"llama.cpp could not make a context for {parallel} sequences of {window} tokens")
        self.batch = llama_cpp.llama_batch_init(MAX_STEP_TOKENS, 0, parallel)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.parallel, self.window = parallel, window
        self.evaluated = 0  # tokens decoded so far (tests count what sharing saves)
        self.steps, self.decoding = 0, 0.0  # llama_decode calls and their seconds, device work included (benches)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def forget(self, slot: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, slot, -1, -1)

    def share(self, source: int, slot: int, positions: int) -> None:
        """Sequence `slot` holds what sequence `source` holds at positions [0, positions)."""
        llama_cpp.llama_memory_seq_cp(self.memory, source, slot, 0, positions)

    def decode(self, entries: list[tuple[int, int, list[int], bool]]) -> None:
        """One llama_decode over (token, position, sequence ids, wants logits) entries."""
        if not self.ctx:
            raise DecodeError("the context is closed")
        self.evaluated += len(entries)
        b = self.batch
        for i, (token, position, slots, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, position, len(slots), logits
            for j, slot in enumerate(slots):
                b.seq_id[i][j] = slot
        b.n_tokens = len(entries)
        started = time.perf_counter()
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise DecodeError(f"llama_decode failed (rc={rc}) on a batch of {len(entries)} tokens")
        llama_cpp.llama_synchronize(self.ctx)  # a GPU's work is done here, not at the first logits read
        self.steps += 1
        self.decoding += time.perf_counter() - started

    def logits_of(self, tokens: list[int]) -> np.ndarray:
        """(len(tokens), V) float32 logits after each of `tokens`, one sequence alone: what checks
        and benches compare with a trainer's. The cache is cleared before and after."""
        self.clear()
        rows = []
        for a in range(0, len(tokens), MAX_STEP_TOKENS):
            part = tokens[a : a + MAX_STEP_TOKENS]
            self.decode([(t, a + k, [0], True) for k, t in enumerate(part)])
            rows += [self.logits(i).copy() for i in range(len(part))]
        self.clear()
        return np.stack(rows)

    def logits(self, i: int) -> np.ndarray:
        """(V,) float32 logits of batch entry i (a view: copy before the next decode)."""
        return self._rows_at(llama_cpp.llama_get_logits_ith(self.ctx, i), 1)[0]

    def rows(self, entries: list[int]) -> np.ndarray:
        """(R, V) float32 logits of batch entries `entries`: a view of llama.cpp's buffer when they are
        its consecutive rows (every step but a prompt's first: one row a sequence, in batch order),
        which spares copying R x V floats a step (19 MB at 32 rows of a 152k vocabulary); a copy
        otherwise (a row serving several sequences). A view is valid until the next decode."""
        pointers = [ctypes.cast(llama_cpp.llama_get_logits_ith(self.ctx, i), ctypes.c_void_p).value for i in entries]
        row_bytes = self.vocab * 4
        if all(b - a == row_bytes for a, b in zip(pointers, pointers[1:])):
            return self._rows_at(pointers[0], len(entries))
        return np.stack([self._rows_at(p, 1)[0] for p in pointers])

    def _rows_at(self, pointer, count: int) -> np.ndarray:
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(count, self.vocab))


def generate(context: BatchContext, requests: list[Request], temperature: float, eos: int, meter: Meter,
             interrupt: threading.Event, follow: Follow | None = None) -> list[Completion]:
    """Each request's completion (its last turn's, when `follow` continued it), decoding them
    together (`engines.backend.Backend.generate`)."""
    queue = deque(enumerate(requests))
    free = list(range(context.parallel - 1, -1, -1))
    live: list[_Sequence] = []
    results: list[Completion | None] = [None] * len(requests)
    started, made = time.perf_counter(), 0
    context.clear()
    try:
        while queue or live:
            if interrupt.is_set():
                raise Interrupted("generation interrupted")
            while queue and free:  # admit requests into free slots
                index, request = queue.popleft()
                live.append(_Sequence(index, free.pop(), request))
            entries, rows, shares = _plan_step(live)
            for source, slot, positions in shares:
                context.share(source, slot, positions)
            context.decode(entries)
            ready = [(s, i) for s, i in rows if i is not None]
            if ready:
                logits = context.rows([i for _, i in ready])  # (R, V), a row may serve several
                tokens, logprobs = sample_rows(
                    logits, temperature, [s.request.seed for s, _ in ready],
                    [s.request.offset + len(s.tokens) for s, _ in ready])
                for (s, _), token, logprob in zip(ready, tokens.tolist(), logprobs.tolist()):
                    s.tokens.append(token)
                    s.logprobs.append(logprob)
                    made += 1
            for s in [s for s, i in ready if s.tokens[-1] == eos or len(s.tokens) >= s.limit]:
                done = Completion(tuple(s.tokens), tuple(s.logprobs))
                following = follow(s.index, done) if follow is not None else None
                if following is None:
                    results[s.index] = done
                    live.remove(s)
                    context.forget(s.slot)
                    free.append(s.slot)
                else:
                    _continue(context, s, following)
    finally:
        context.clear()
        meter.add(made, started)
    return results


Entry = tuple[int, int, list[int], bool]  # token, position, sequence ids, wants logits


def _plan_step(live: list[_Sequence]) -> tuple[list[Entry], list[tuple[_Sequence, int | None]], list[tuple[int, int, int]]]:
    """This step's batch entries; for each live sequence the entry whose logits it samples from
    (None: its prompt needs more steps); and the cells to share first, (source slot, slot,
    positions). Fresh sequences with the same prompt (a group's samples) share its entries: the
    tokens enter once, tagged with each of their sequence ids. When a live sequence already holds
    that prompt, they share its cells instead and only the prompt's last token is evaluated."""
    entries: list[Entry] = []
    rows: list[tuple[_Sequence, int | None]] = []
    shares: list[tuple[int, int, int]] = []
    holders: dict[tuple[int, ...], int] = {}  # a prompt -> a live sequence holding all of it
    if any(s.cached == 0 for s in live):  # only then: hashing every live prompt each step is not free
        holders = {s.request.prompt_ids: s.slot for s in live if s.cached >= len(s.request.prompt_ids)}
    shared: dict[tuple[int, ...], tuple[int, int]] = {}  # a fresh prompt -> its entries [first, last]
    budget = MAX_STEP_TOKENS
    for s in live:
        prompt = s.request.prompt_ids
        fresh = s.cached == 0 and len(s.pending()) <= budget
        if fresh and prompt in holders and len(prompt) > 1:
            shares.append((holders[prompt], s.slot, len(prompt) - 1))
            s.cached = len(prompt) - 1
        if fresh and prompt in shared:
            first, last = shared[prompt]
            for i in range(first, last + 1):
                entries[i][2].append(s.slot)
            s.cached = len(prompt)
            rows.append((s, last))
            continue
        pending = s.pending()
        take = pending[:budget]
        budget -= len(take)
        for k, token in enumerate(take):
            entries.append((token, s.cached + k, [s.slot], k == len(pending) - 1))
        s.cached += len(take)
        whole = bool(take) and len(take) == len(pending)
        if fresh and whole:
            shared[prompt] = (len(entries) - len(take), len(entries) - 1)
        rows.append((s, len(entries) - 1 if whole else None))
    return entries, rows, shares


def _continue(context: BatchContext, s: _Sequence, request: Request) -> None:
    """Make `request` (a later turn) the sequence's; the cache keeps what its prompt repeats."""
    held = s.request.prompt_ids + tuple(s.tokens[:-1])  # the last sampled token was never evaluated
    if request.prompt_ids[: len(held)] != held:
        context.forget(s.slot)
        s.cached = 0
    s.request, s.tokens, s.logprobs = request, [], []

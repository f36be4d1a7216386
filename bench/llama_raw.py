"""llama.cpp's generation without the node around it, for benches to compare the node's backend
with: llama-cpp-python's own single-stream path, and llama.cpp's batched decode alone.

G = 8 samples of at most 32 tokens a prompt, T = 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from echo_coordinator.main import demo_model_path
from engines.llama_device import CPU_SETTINGS, ContextSettings

GROUP, MAX_NEW = 8, 32
FIRST_SEED = 500_000  # where an async run with seed 0 starts leasing


def prompts(count: int) -> list[tuple[int, ...]]:
    from engines.hf import load_tokenizer, prompt_ids
    from tasks import make_task

    tokenizer, task = load_tokenizer(demo_model_path()), make_task("arithmetic")
    return [tuple(prompt_ids(tokenizer, task.episode(FIRST_SEED + i).messages)) for i in range(count)]


def wide_model(directory: Path, vocab: int, quant: str | None = None, arch: str = "llama", **shape) -> Path:
    """A random model (default: a tiny Llama, 2 layers, width 64; `shape`: config fields) with a
    `vocab`-entry vocabulary: SmolLM2's tokens padded with unused ones, so the prompts tokenize the
    same. fp32, or quantized to `quant` (a llama.cpp file type name)."""
    import gguf

    from engines.gguf_io import _tokenizer_fields, write_model
    from tests.support.tiny_model import smollm2_gguf, tiny_model

    source = smollm2_gguf()
    stat = source.stat()

    def tokenizer(writer) -> None:
        for name, value, kind, sub in _tokenizer_fields(str(source), stat.st_size, stat.st_mtime_ns):
            if isinstance(value, list) and name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                    "tokenizer.ggml.scores"):
                pad = vocab - len(value)
                value = value + {"tokenizer.ggml.tokens": [f"<unused_{i}>" for i in range(pad)],
                                 "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad,
                                 "tokenizer.ggml.scores": [0.0] * pad}[name]
            writer.add_key_value(name, value, kind, sub_type=sub)

    model = tiny_model(arch, seed=0, init_std=0.3, vocab_size=vocab, **shape)
    path = directory / "wide.gguf"
    write_model(model.config, {k: v.detach().float().numpy() for k, v in model.state_dict().items()}, path, tokenizer)
    del model
    if quant is None:
        return path
    from engines.gguf_io import quantize

    out = quantize(path, directory / f"wide-{quant}.gguf", quant)
    path.unlink()
    return out


@dataclass(frozen=True)
class Rate:
    """A batched run: tokens/s, and the host's time a step outside llama_decode (the sampler, the
    batch's filling, reading logits): on a GPU, what the node adds to each step's device work."""

    tokens_per_s: float
    host_ms_per_step: float
    decode_ms_per_step: float  # llama_decode's, device work included
    lengths: list[int]  # each completion's, in request order

    @staticmethod
    def of(made: int, lengths: list[int], seconds: float, context) -> "Rate":
        steps = max(context.steps, 1)
        return Rate(made / seconds, 1000 * (seconds - context.decoding) / steps, 1000 * context.decoding / steps, lengths)


def requests_of(batch: list[tuple[int, ...]]):
    from engines.backend import Request

    return [Request(p, MAX_NEW, 1000 * i + j) for i, p in enumerate(batch) for j in range(GROUP)]


def raw_single(model: Path, batch, threads: int, gpu_layers: int = 0) -> float:
    """One sequence at a time through llama-cpp-python's own generate and sampler."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=2048, verbose=False, n_threads=threads, n_threads_batch=threads,
                          n_gpu_layers=gpu_layers)
    eos, made, started = llm.token_eos(), 0, time.perf_counter()
    for r in requests_of(batch):
        llm.set_seed(r.seed)
        for n, token in enumerate(llm.generate(list(r.prompt_ids), temp=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                               reset=True), 1):
            if token == eos or n == MAX_NEW:
                break
        made += n
    return made / (time.perf_counter() - started)


def raw_batched(model: Path, batch, parallel: int, threads: int, lengths: list[int], gpu_layers: int = 0,
                settings: ContextSettings = CPU_SETTINGS) -> Rate:
    """B sequences a wave, each prompt's G sequences sharing it; greedy, sequence i decoding
    `lengths[i]` tokens (the backend's: the same work, so only the overhead differs)."""
    import llama_cpp

    from engines.llama_batch import BatchContext

    llm = llama_cpp.Llama(str(model), n_ctx=32, verbose=False, n_gpu_layers=gpu_layers)
    context = BatchContext(llm.model, parallel, 512, threads, settings)
    requests = requests_of(batch)
    made, started = 0, time.perf_counter()
    for wave in range(0, len(requests), parallel):
        live = requests[wave : wave + parallel]
        wanted = lengths[wave : wave + parallel]
        context.clear()
        entries, rows, seen = [], [], {}
        for slot, r in enumerate(live):
            if r.prompt_ids in seen:
                for i in range(seen[r.prompt_ids] - len(r.prompt_ids) + 1, seen[r.prompt_ids] + 1):
                    entries[i][2].append(slot)
            else:
                entries += [(t, k, [slot], k == len(r.prompt_ids) - 1) for k, t in enumerate(r.prompt_ids)]
                seen[r.prompt_ids] = len(entries) - 1
            rows.append(seen[r.prompt_ids])
        active = list(range(len(live)))
        for step in range(max(wanted)):
            context.decode(entries)
            tokens = [int(np.argmax(context.logits(i))) for i in rows]
            made += len(tokens)
            entries = [(t, len(live[k].prompt_ids) + step, [k], True)
                       for k, t in zip(active, tokens) if step + 1 < wanted[k]]
            active = [k for k in active if step + 1 < wanted[k]]
            rows = list(range(len(active)))
    context.close()
    return Rate.of(made, lengths, time.perf_counter() - started, context)


def backend_rate(model: Path, batch, parallel: int, threads: int, **options) -> Rate:
    """Tokens/s of the node's backend, and each completion's length. `options`: LlamaBackend's.
    The sampler is compiled first, as a node's worker does before it joins: a fresh machine's first
    call otherwise times numba's compile (4 s here: backend@8 read 0.04 x raw batched)."""
    from engines.llama_backend import LlamaBackend
    from engines.sampler import sample_rows

    for seed in (1, None):
        sample_rows(np.zeros((1, 8), np.float32), 1.0, [seed], [0])
    backend = LlamaBackend(model, threads=threads, n_ctx=512, parallel=parallel, **options)
    started = time.perf_counter()
    lengths = [len(c.token_ids) for c in backend.generate(requests_of(batch), 1.0)]
    return Rate.of(sum(lengths), lengths, time.perf_counter() - started, backend.batch)

"""The node's generation on a llama.cpp GPU backend (CUDA, Vulkan, Metal): tokens/s side by side.

For each context setting the node may use there (`engines.llama_device.candidates`: the fp16 KV
cache with flash attention, then the fp32 cache), first a probe in a process of its own (a crash
is a row, not the end), then, with every layer offloaded:
- raw single: llama-cpp-python's `Llama.generate`, one sequence at a time;
- raw batched@B: llama.cpp's batched decode of B sequences, nothing else (`bench/llama_raw.py`);
- backend@B: the node's `LlamaBackend.generate` at `parallel` B (lease noise, behaviour logprobs).
The model: a random Qwen2-1.5B-shaped model with a 151,936-entry vocabulary as q4_k_m (`--shape
1.5b`), a tiny one (`--shape tiny`), or a GGUF file (`--model`).

    python bench/gpu_node.py [--shape 1.5b] [--batches 1,8,32,64] [--model FILE] [--gpu-layers -1]

Prints a JSON line per measurement as it is made, then one with the ratios per setting:
`backend_over_raw_batched@B` (goal >= 0.9 at 8 and 32) and `batched32_over_single` (goal >= 3),
and `host_ms_per_step@B`, [backend, raw batched]: the host's time a step outside llama_decode (its
device work included), which is what the node adds to a GPU's step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engines import llama_device, llama_probe  # noqa: E402
from llama_raw import GROUP, MAX_NEW, backend_rate, prompts, raw_batched, raw_single, wide_model  # noqa: E402

SHAPES = {  # Qwen2.5-1.5B's config, and a tiny one for checking the script on a CPU
    "1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096),
    "tiny": dict(arch="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
VOCAB = 151936


def emit(**row) -> dict:
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="1.5b")
    parser.add_argument("--model", type=Path, help="a GGUF to run instead of a generated model")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="the generated model's vocabulary (SmolLM2's 49,152 and up)")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--gpu-layers", type=int, default=-1)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--kv", choices=list(llama_device.KV_TYPES), help="only this KV cache type")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import llama_cpp

    offloaded = bool(llama_cpp.llama_supports_gpu_offload()) and args.gpu_layers != 0
    emit(devices=[str(d) for d in llama_device.gpu_devices()], offloaded=offloaded)
    with tempfile.TemporaryDirectory(prefix="echo-gpu-node-") as tmp:
        model = args.model
        if model is None:
            started = time.perf_counter()
            model = wide_model(Path(tmp), args.vocab, "q4_k_m", **SHAPES[args.shape])
            emit(model=f"{args.shape} q4_k_m", mb=round(model.stat().st_size / 1e6), seconds=round(time.perf_counter() - started, 1))
        texts = prompts(max(2, max(batches) // GROUP))
        summary = {}
        for settings in llama_device.candidates(offloaded, args.kv):
            name = f"{settings.kv}{'+fa' if settings.flash_attn else ''}"
            failure = llama_probe.probe(model, args.gpu_layers, max(batches), 512, settings)
            emit(settings=name, probe=failure or "ok")
            if failure:
                summary[name] = dict(failed=failure)
                continue
            rates = {"raw single": raw_single(model, texts[:1], args.threads, args.gpu_layers)}
            emit(settings=name, part="raw single", tokens_per_s=round(rates["raw single"], 1))
            host = {}  # ms a step outside llama_decode: what explains a backend below raw batched
            for b in batches:
                batch = texts[: max(1, b // GROUP)]
                # Untimed first: a backend compiles kernels for a shape at its first use (lavapipe's
                # pipelines for a batch of 32 cost whichever path ran first 1.4-1.7x a step).
                raw_batched(model, batch, b, args.threads, [MAX_NEW] * len(batch) * GROUP, args.gpu_layers, settings)
                backend = backend_rate(model, batch, b, args.threads, gpu_layers=args.gpu_layers, kv=settings.kv)
                raw = raw_batched(model, batch, b, args.threads, backend.lengths, args.gpu_layers, settings)
                rates[f"backend@{b}"], rates[f"raw batched@{b}"] = backend.tokens_per_s, raw.tokens_per_s
                host[f"host_ms_per_step@{b}"] = [round(r.host_ms_per_step, 2) for r in (backend, raw)]
                emit(settings=name, batch=b, backend=round(backend.tokens_per_s, 1), raw_batched=round(raw.tokens_per_s, 1),
                     host_ms_per_step=host[f"host_ms_per_step@{b}"],
                     decode_ms_per_step=[round(r.decode_ms_per_step, 2) for r in (backend, raw)])  # [backend, raw]
            summary[name] = {f"backend_over_raw_batched@{b}": round(rates[f"backend@{b}"] / rates[f"raw batched@{b}"], 3)
                             for b in batches}
            summary[name].update(host)  # [backend, raw]
            if 32 in batches:
                summary[name]["batched32_over_single"] = round(rates["raw batched@32"] / rates["raw single"], 2)
                summary[name]["backend32_over_single"] = round(rates["backend@32"] / rates["raw single"], 2)
        emit(summary=summary)


if __name__ == "__main__":
    main()

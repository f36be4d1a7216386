"""The inference peer a volunteer runs: `echo-node join ADDR --run-key FINGERPRINT --model FILE.gguf`.

- `cli`            typer entry point (heavy imports happen after argument parsing)
- `node`           the process: verify the run, announce, lease -> update -> generate -> push
- `updates`        plan a catch-up chain, fetch (peers first), verify, apply or stay put
- `llama_backend`  llama-cpp-python sampling with exact behaviour logprobs; LoRA hot-swap
- `transformers_backend`  the same on transformers (CUDA when present), full-mode updates in place
- `full_weights`   full mode: float32 master weights, bit-exact delta application, GGUF re-export
- `gguf_io`        GGUF writers: LoRA adapters and whole Llama models (HF -> llama.cpp layout)
"""

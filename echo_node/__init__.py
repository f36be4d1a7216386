"""The inference peer a volunteer runs: `echo-node join ADDR --run-key FINGERPRINT --model FILE.gguf`.

- `cli`            typer entry point (heavy imports happen after argument parsing)
- `node`           the process: verify the run, announce, lease -> update -> generate -> push
- `updates`        fetch a WeightUpdate, verify signature and chunk hashes, apply or stay put
- `llama_backend`  llama-cpp-python sampling with exact behaviour logprobs; LoRA hot-swap
- `gguf_io`        GGUF writers: LoRA adapters and whole Llama models (HF -> llama.cpp layout)
"""

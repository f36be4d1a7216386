"""What both peers need of models, below both: nothing here imports `echo_node` or
`echo_coordinator`; it stands on `protocols` and `tasks` only.

- `backend`               the `Backend` protocol a node generates through, `Completion`, throughput, hardware
- `llama_backend`         llama-cpp-python: Gumbel-max sampling with exact behaviour logprobs, LoRA hot-swap
- `transformers_backend`  the same on transformers (CUDA when present), full-mode updates in place
- `episodes`              the turn rules: `rollout`/`play` (node) and `score` (trainer's replay)
- `gguf_io`               GGUF files: architectures table, file types, LoRA adapters, whole models, quantize
- `hf`                    transformers loading (checkpoint or GGUF), distinct weights, chat template prompts
- `full_weights`          full mode on llama.cpp: master weights re-exported as GGUF and requantized
"""

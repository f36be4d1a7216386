"""What both peers need of models, below both: nothing here imports `echo_node` or
`echo_coordinator`; it stands on `protocols` and `tasks` only.

- `backend`               the `Backend` protocol a node generates through (`Request`s in, `Completion`s out)
- `sampler`               verifiable Gumbel-max at compiled speed: the node's sampling, the CPU verifier's margins
- `device_sampler`        the verifier's margins over a forward batch's logits on any torch device, one transfer a batch
- `triton_scan`           its one pass a row on a GPU (Triton): log-sum-exp, the noise, the best two z
- `llama_process`         the node's llama.cpp: a `llama_backend` in a worker process (`llama_worker`),
                          confined (`sandbox`), restarted when it dies, its answers checked
- `llama_backend`         llama-cpp-python: the model, LoRA hot-swap, full-mode reloads
- `llama_batch`           llama.cpp batched decoding: a lease's sequences in one context, shared prompts
- `transformers_backend`  the same on transformers (CUDA when present), full-mode updates in place
- `episodes`              the turn rules: `rollouts`/`Game` (node) and `score` (trainer's replay)
- `gguf_io`               GGUF files: architectures table, file types, LoRA adapters, whole models, quantize
- `gguf_read`             a GGUF file read without mapping it: one header field, tensors dequantized
- `hf`                    transformers loading (checkpoint or GGUF), distinct weights, chat template prompts
- `full_weights`          full mode: master weights re-exported as GGUF and requantized, and read back (what nodes hold)
"""

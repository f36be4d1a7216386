"""Launching and running a run: `echo-coordinator start`, `echo-coordinator status`.

- `cli`          typer entry point (heavy imports happen after argument parsing)
- `config`       RunConfig / TrainerConfig from run.toml plus CLI overrides
- `coordinator`  the process: DHT bootstrap, manifest, stream handlers, the step loop
- `service`      the handlers' logic (leases, pushes, updates, chunks), transport-free
- `grpo`         advantages and the GRPO + truncated-importance-sampling objective
- `trainer`      LoRA (peft) over the base model loaded from the run's GGUF
- `publish`      trainer weights -> signed WeightUpdate + content-addressed chunks
- `ledger`       SQLite contribution ledger and metrics.jsonl
- `demo`         `make demo`: coordinator + two local nodes
- `configs/`     shipped run.toml examples
"""

"""Launching and watching a run: `echo-coordinator start`, `status`, `dashboard`.

- `cli`          typer entry point (heavy imports happen after argument parsing)
- `config`       RunConfig / TrainerConfig from run.toml plus CLI overrides
- `coordinator`  the process: DHT bootstrap, manifest, stream handlers, the step loop
- `service`      the handlers' logic (leases, pushes, updates, chunks), transport-free
- `grpo`         advantages and the GRPO + truncated-importance-sampling objective
- `trainer`      LoRA (peft) over the base model loaded from the run's GGUF
- `publish`      trainer weights -> signed WeightUpdate + content-addressed chunks
- `ledger`       SQLite contribution ledger and metrics.jsonl
- `capacity`     the capacity model (do the nodes keep the trainer busy?) and measured node throughput
- `observe`      one reading of a run (ledger, metrics, live state) for everything below
- `web`          the dashboard's server: `dashboard.html`, JSON API, Prometheus /metrics
- `report`       `echo-coordinator status`: the same reading in a terminal
- `demo`         `make demo`: coordinator + two local nodes
- `configs/`     shipped run.toml examples
"""

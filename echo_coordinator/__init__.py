"""Launching and watching a run: `echo-coordinator start`, `status`, `dashboard`.

- `cli`          typer entry point (heavy imports happen after argument parsing)
- `config`       RunConfig / TrainerConfig from run.toml plus CLI overrides; the one strict reader
- `main`         the process: logging, the live line, signals -> `Stopped`, exit codes
- `startup`      `Coordinator`: the wiring in start-up order (trainer, DHT, manifest, service, resume)
- `steps`        the step loop, its metrics record, transcripts, evaluation records, the end of the run
- `versions`     publishing a version: signed updates, what nodes hold, adapters, checkpoints
- `handlers`     the stream handlers (manifest, reach, lease, push, relay) and the wait for nodes
- `presence`     the manifest record kept alive in the DHT; who holds which version, who is alive
- `display`      the console: the live status line or a line per step; starting the dashboard
- `torch_thread` the one thread torch work runs on
- `run_dir`      the run directory's file layout: state.json, checkpoints, adapters, logs, ...
- `service/`     the handlers' logic (leases, pushes, evaluation, policing), transport-free
- `trainer/`     the learner: GRPO, the Trainer (LoRA or full), the trainer ranks
- `publish`      trainer weights -> signed WeightUpdate + content-addressed chunks
- `verify`       checking the nodes' sampling against the weights they hold
- `base_model`   `--model`: what the trainer loads and the GGUF the nodes run
- `memory_plan`  bytes per trainer rank from the model's config.json
- `memory_check` the start-up refusal of a trainer this machine cannot hold, with what would fit
- `ledger`       SQLite contribution ledger and metrics.jsonl; `journal`: buffered groups and leases
- `capacity`     the capacity model (do the nodes keep the trainer busy?) and measured node throughput
- `observe`      one reading of a run (ledger, metrics, live state) for everything below
- `web`          the dashboard's server: `dashboard.html`, JSON API, Prometheus /metrics
- `report`       `echo-coordinator status`: the same reading in a terminal
- `local_eval`, `export`  `echo-coordinator eval` / `export`, from the run directory alone
- `demo`         `make demo`: coordinator + two local nodes
- `configs/`     shipped run.toml examples

Who owns what in the coordinator process:
- The event loop (one asyncio loop, `main.until_stopped`): the step loop, the DHT refresh
  (`Presence.peer_versions`, replaced whole), the live line (`Display`), the dashboard, the
  stream handlers' coroutines, and every write to the run directory's state.json and metrics.
- The torch thread (`TorchThread`, one thread for the whole run): the trainer and the checker
  model, `Versions` (publisher, adapters, checkpoints) and the verifier's forward passes;
  `TorchThread.busy` says a call is running (the process exits rather than wait for it).
- Handler threads (`asyncio.to_thread` per lease and push): `RunService`, whose state changes
  only under its lock, by its own methods; verification waits for the torch thread from there.
"""

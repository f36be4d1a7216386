"""The inference peer a volunteer runs: `echo-node join ADDR --run-key FINGERPRINT [--model FILE.gguf]`.
Its models and generation are `engines/`; this package is the process around them.

- `cli`            typer entry point (heavy imports happen after argument parsing)
- `config`         NodeConfig, checked when made; JoinRefused and Stopped, the errors that end a node on purpose
- `main`           run_node, the process shell (logging, live status line, signals, exit codes), and the
                   order of a node's life: join the swarm, join the run, load the model, work, leave
- `session`        what every part shares: identity, console, stop signals, the "cannot reach" message
- `presence`       the DHT, reachability behind NAT and the relay, who holds a version (asked of the coordinator)
- `join`           the run's manifest checked against the pinned key, its trainer, its base model; Phases
- `versions`       which version the node serves and moving to a lease's (the node-side staleness gate)
- `work`           the loop: lease -> version -> generate -> push, one push in flight beside generation
- `rollouts`       a lease's batch: samples with their noise seeds, signed
- `updates`        plan a catch-up chain, fetch (peers first), verify, apply or stay put
- `base_download`  the base model GGUF as signed, content-addressed chunks from the coordinator and peers
- `disk`           the data dir under --max-disk: every write checked first, old cached bases make room

Trust: the join line pins the run key's fingerprint. The manifest, every WeightUpdate and
(through their hashes) every chunk are checked against it before use; a failed update leaves
the node on its old version, still serving.

Who owns what. One asyncio event loop runs everything but generation and weight loading:
`Session` (identity, stop events, when the coordinator last answered), `Presence` (DHT,
endpoint, the holders the coordinator named), `Versions` (`version`,
`master`, `loaded`), `Work` (`accepted`, `latest`, the push in flight) and the `Relay` each
change only their own state, on the loop. Worker threads (`asyncio.to_thread`) run generation
(`Rollouts.generate`: reads the backend and the run, writes nothing shared, watches
`Session.stop_requested`) and weight decoding and loading for `Versions` (`apply_update` builds
a new dict the loop then commits; a full-mode reload sets `loaded` while the loop awaits it).
The backend is used by one thread at a time: the work loop awaits
generation before it moves to the next version. `SwarmDHT.start` runs on the main thread (see
its docstring).
"""

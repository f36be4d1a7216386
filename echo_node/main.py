"""The node process from start to exit: the shell (logging, the live status line, signals, exit
codes) and the order of a node's life: join the swarm, join the run, load the model, work, leave."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from rich.text import Text

from echo_node import join
from echo_node.config import JoinRefused, NodeConfig, Stopped
from echo_node.disk import touch
from echo_node.presence import Presence
from echo_node.rollouts import Rollouts, load_task
from echo_node.session import Session, console
from echo_node.versions import Versions
from echo_node.work import Work
from engines.episodes import context_window
from engines.llama_process import LlamaProcess
from engines.worker_process import Spawned
from protocols.errors import EchoError
from protocols.messages import RunManifest
from protocols.supervise import Supervisor
from protocols.transport.relay import Relay
from protocols.uploads import ByteQuota

STOP_SECONDS = 5.0  # on Ctrl-C, how long the work gets to end before we leave anyway


def run_node(config: NodeConfig) -> int:
    """Run a node until the run ends or Ctrl-C; the process's exit code."""
    # On a terminal, one live status line; in a log file (or with --verbose), a line per event.
    live = console.is_terminal and not config.verbose
    logging.basicConfig(level=logging.WARNING if live else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with console.status("starting ...") if live else contextlib.nullcontext() as status:
            asyncio.run(live_node(Session(config, status)))
    except JoinRefused as e:
        console.print(Text.assemble(("refused to join: ", "red"), str(e)))
        return 3
    except Stopped as e:  # asked to stop, like a Ctrl-C mid-run: not a failure
        console.print(Text(str(e), "yellow"))
        return 0
    except (EchoError, OSError) as e:
        console.print(Text.assemble(("error: ", "red"), str(e)))
        return 1
    return 0


async def live_node(session: Session) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, session.request_stop)
    phases = join.Phases()  # where the time from start to the first accepted rollout went
    presence = Presence(session)
    # llama.cpp's worker starts now, its imports overlapping the join; it loads the model later.
    spawned = None if session.config.backend == "transformers" else Spawned()
    try:
        if not await presence.join():
            return  # stopped before the coordinator could be reached
        phases.mark("DHT")
        await _take_part(session, presence, phases, spawned)
    finally:
        presence.shutdown()
        if spawned is not None:
            spawned.close()


async def _take_part(session: Session, presence: Presence, phases: join.Phases, spawned: Spawned | None) -> None:
    endpoint = await presence.open_endpoint()
    manifest = await join.fetch_manifest(session, presence.dht, endpoint)
    trainer = join.trainer_peer(manifest)
    listed = await join.model_file(session, endpoint, trainer, manifest)
    phases.mark("manifest")
    model = await join.base_model(session, endpoint, trainer, manifest, listed,
                                  presence.holders)
    phases.mark("base model")
    config = session.config
    # Bursts of one base-download batch (8 chunks of 4 MiB) at most, at the volunteer's rate.
    relay = Relay(quota=ByteQuota(rate=config.upload_mib_per_s * 2**20, burst=32 * 2**20,
                                  per_hour=config.upload_gib_per_hour * 2**30))
    relay.serve_file(listed, model)  # every node serves the base to later joiners
    task = load_task(manifest, config.allow_tasks) if manifest.task.max_turns > 1 else None
    session.waiting(f"loading {manifest.base_model} ...")
    backend, master = await asyncio.to_thread(_load_backend, session, manifest, model, spawned)
    await relay.serve(endpoint)
    phases.mark("model load")
    console.print(f"joined run {manifest.run_id} as {session.name} (node key {session.fingerprint}); "
                  f"task {manifest.task.name}, mode {manifest.mode}; {backend.hardware}")
    versions = Versions(session, presence, trainer, manifest, backend, master, relay)
    work = Work(session, endpoint, trainer, manifest, backend, versions, Rollouts(session, manifest, backend, task),
                phases)
    await _serve(session, presence, versions, work)


async def _serve(session: Session, presence: Presence, versions: Versions, work: Work) -> None:
    """Work until the run ends, a stop, or a background task's failure (which ends the node with
    that task's name and cause: `BackgroundFailed`)."""
    supervisor = Supervisor()
    if presence.via_relay:
        supervisor.start(presence.confirm_relay(), "relay")
    try:
        # Ctrl-C cancels whatever call is in flight; bounded: the generation thread stops at its next token.
        await session.until_stopped(supervisor.run(work.run()), grace=STOP_SECONDS)
    finally:
        console.print(f"left the run at version {versions.version}")


def _make_room_for_checkpoint(session: Session, manifest: RunManifest, model: Path) -> None:
    """Full mode: the base's float32 checkpoint (the master weights load from it) is kept in the
    data dir, under `--max-disk`, room made before it is written; a cached one is used as it is."""
    from engines import hf

    hf.use_cache(session.data_dir)
    target = hf.checkpoint_dir(manifest.base_sha256)
    if (target / "config.json").exists():
        touch(target / "config.json")  # used now (`disk.used_at`): other runs' checkpoints go first
    else:
        session.disk.make_room(hf.checkpoint_bytes(model), "the base model's float32 checkpoint", keep=[model])


def _load_backend(session: Session, manifest: RunManifest, model: Path, spawned: Spawned | None):
    """The generation backend, and the master weights updates apply to: in LoRA mode the adapter,
    empty until the first update; in full mode None, the float32 base weights, which `Versions`
    loads only when a delta needs them. The config chooses the backend; nothing else asks which
    one it is."""
    config = session.config
    # The run's window, not ours: the trainer refuses a transcript that ends anywhere else.
    window = context_window(manifest.max_new_tokens, manifest.task.max_turns > 1)
    if manifest.update == "full":
        _make_room_for_checkpoint(session, manifest, model)
    if config.backend == "transformers":
        from engines.transformers_backend import TransformersBackend

        if manifest.update != "full":
            raise JoinRefused("the transformers backend takes full-parameter runs (update = \"full\") only")
        if config.parallel not in (None, 1):
            raise JoinRefused("the transformers backend decodes one sequence at a time: leave --parallel out")
        backend = TransformersBackend(model, config.threads, window)
    else:
        # llama.cpp reads the model, our adapters (`updates.load_lora`) and writes full mode's exports
        # (`Versions`), and nothing else of the data dir: not the node key.
        backend = LlamaProcess(model, config.threads, window, interrupt=session.stop_requested,
                               readable=(session.data_dir / "adapters",), writable=(session.data_dir / "weights",),
                               confine=config.sandbox, gpu_layers=config.gpu_layers, kv=config.kv,
                               max_vram_gib=config.max_vram_gib, cpu_moe=config.cpu_moe, n_cpu_moe=config.n_cpu_moe,
                               spawned=spawned,
                               **({"parallel": config.parallel} if config.parallel else {}))
        console.print(f"llama.cpp runs in a worker process: {backend.confined}; "
                      f"it may hold {backend.max_memory / 2**30:.1f} GiB of memory")
        if backend.fitted:
            console.print(backend.fitted)
    return backend, None if manifest.update == "full" else {}

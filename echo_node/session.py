"""What every part of one node process shares: who it is, what the person running it sees, when
it is asked to stop, and when the coordinator last answered (the "cannot reach" message)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.text import Text

from echo_node.config import NodeConfig, Stopped
from echo_node.disk import Disk
from protocols.signing import fingerprint, load_or_create_key, public_bytes

log = logging.getLogger(__name__)
# No markup: what the node prints carries peers' text (run ids, task names, error messages), and
# rich markup in it would render, `[link=...]` as a terminal hyperlink. Colour goes through `Text`.
console = Console(soft_wrap=True, markup=False, highlight=False)

UNREACHABLE_SAY = 60.0  # seconds without an answer from the coordinator before we say so (then each such period)

T = TypeVar("T")


class Session:
    """One node process. `main` makes it; the parts read its fields and call its methods, and
    only its own methods change it. Event-loop side, except `stop_requested`."""

    def __init__(self, config: NodeConfig, status=None):
        self.config = config
        self.data_dir = Path(config.data_dir).expanduser()
        (self.data_dir / "adapters").mkdir(parents=True, exist_ok=True)
        limit = config.max_disk_gib
        self.disk = Disk(self.data_dir, None if limit is None else int(limit * 2**30))
        self.key = load_or_create_key(self.data_dir / "node.key")
        self.node_key = public_bytes(self.key)
        self.fingerprint = fingerprint(self.node_key)
        self.name = config.name or f"node-{self.fingerprint[:6]}"
        self.status = status  # rich Status: the live line, or None to print each event
        self.stopping = asyncio.Event()  # Ctrl-C or SIGTERM, for the event loop
        self.stop_requested = threading.Event()  # the same, seen by the generation thread (llama.cpp: between tokens)
        self.last_answer = time.monotonic()  # the coordinator last answered us (anything, even a refusal)
        self.said_unreachable = 0.0  # when we last said it has not

    def request_stop(self) -> None:
        self.stopping.set()
        self.stop_requested.set()

    def say(self, event: str, facts: str) -> None:
        """An event: a line of its own without a live status line, else that line: `facts · event`."""
        if self.status is None:
            console.print(event)
        else:
            self.status.update(Text(f"{facts} · {event}"))  # Text: a status line's str is read as markup

    def waiting(self, what: str) -> None:
        """A long wait, shown on the live line (and logged without one)."""
        if self.status is not None:
            self.status.update(Text(what))
        else:
            log.info(what)

    def answered(self) -> None:
        """The coordinator answered (a refusal counts): it is reachable."""
        self.last_answer = time.monotonic()

    async def pause(self, error: BaseException, delay: float) -> None:
        """`retry`'s wait for calls to the coordinator: log the failure and wait `delay` (a stop
        ends the wait); say so plainly when the coordinator has not answered for a while."""
        log.warning("%s; retrying in %.1f s", error, delay)
        silent = time.monotonic() - self.last_answer
        if silent > UNREACHABLE_SAY and time.monotonic() - self.said_unreachable > UNREACHABLE_SAY:
            self.said_unreachable = time.monotonic()
            console.print(Text.assemble((f"cannot reach the coordinator at {self.config.address} for "
                                         f"{silent / 60:.0f} min", "yellow"),
                                        f" ({error}); still trying: this node picks up again when the coordinator "
                                        "is back"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), delay)

    async def pause_or_stop(self, error: BaseException, delay: float) -> None:
        """`pause`, then `Stopped` if a stop ended it: ends a `retry` that no one else cancels."""
        await self.pause(error, delay)
        if self.stopping.is_set():
            raise Stopped("stopped")

    async def until_stopped(self, work: Awaitable[T], grace: float | None = None) -> T | None:
        """`work`'s result, or None when a stop comes first: then `work` is cancelled, which ends
        the call in flight instead of waiting out its timeout, and given `grace` seconds to end
        (None: as long as it takes)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.create_task(self.stopping.wait(), name="stop")
        try:
            done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            return task.result() if task in done else None
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=grace)

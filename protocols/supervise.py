"""Background work that is watched: retried with backoff when the failure is transient, the
process told when it is not. Shared by the node and the coordinator; asyncio only.

A process runs its main work with `Supervisor.run(main)`: if a background task dies of anything
but cancellation, main is cancelled and `BackgroundFailed` names the task and the cause, so
nothing stops silently while the rest goes on. Loops that talk to the network use `Backoff`
and log each transient failure with its cause before they retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass

from protocols.errors import EchoError


@dataclass
class Backoff:
    """Delays between retries: `first`, doubling up to `cap`; `reset()` after a success."""

    first: float = 0.5
    cap: float = 30.0
    delay: float = 0.0

    def next(self) -> float:
        self.delay = self.first if self.delay == 0 else min(self.delay * 2, self.cap)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


class BackgroundFailed(EchoError):
    """A background task stopped with an error: the process ends with this message."""


class Supervisor:
    def __init__(self) -> None:
        self.tasks: list[asyncio.Task] = []

    def start(self, coro: Coroutine, name: str) -> asyncio.Task:
        """Run `coro` in the background for as long as the main work runs."""
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task

    async def run(self, main: Awaitable):
        """Await `main`; raise `BackgroundFailed` as soon as a background task fails. Background
        tasks are cancelled when main ends, however it ends."""
        work = asyncio.ensure_future(main)
        try:
            while True:
                watched = {work, *[t for t in self.tasks if not t.done()]}
                done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if work in done:
                    return work.result()
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        e = task.exception()
                        raise BackgroundFailed(f"{task.get_name()} stopped: {type(e).__name__}: {e}") from e
        finally:
            for task in [work, *self.tasks]:
                task.cancel()
            await asyncio.gather(work, *self.tasks, return_exceptions=True)

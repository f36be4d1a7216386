"""Background work that is watched: retried with backoff when the failure is transient, the
process told when it is not. Shared by the node and the coordinator; asyncio only.

A process runs its main work with `Supervisor.run(main)`: if a background task dies of anything
but cancellation, main is cancelled and `BackgroundFailed` names the task and the cause, so
nothing stops silently while the rest goes on. Calls to a peer that may fail for a while go
through `retry`, which waits by `Backoff` (or briefly, when the peer is only busy) and lets the
caller log each failure with its cause and decide when to give up.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

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


async def _sleep(error: BaseException, delay: float) -> None:
    await asyncio.sleep(delay)


async def retry(attempt: Callable[[], Awaitable[T]], transient: type[BaseException] | tuple[type[BaseException], ...], *,
                backoff: Backoff | None = None, wait: Callable[[BaseException, float], Awaitable[None]] = _sleep,
                busy: Callable[[BaseException], bool] = lambda e: False, busy_delay: float = 0.3,
                give_up: Callable[[BaseException, float], bool] = lambda e, delay: False) -> T:
    """`attempt()`'s result, tried again while it raises one of `transient`: after `backoff`'s
    next delay, or after `busy_delay` when `busy(error)` (the peer is busy, not failing: the
    backoff does not grow). `wait(error, delay)` does the waiting (and the logging); a failure
    for which `give_up(error, delay)` is true is raised instead. Other errors propagate."""
    backoff = backoff or Backoff()
    while True:
        try:
            result = await attempt()
        except transient as e:
            delay = busy_delay if busy(e) else backoff.next()
            if give_up(e, delay):
                raise
            await wait(e, delay)
            continue
        backoff.reset()
        return result


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


def run_and_exit(main: Callable[[], object]) -> None:
    """Run a command-line program's `main` and exit as Python would (non-daemon threads joined,
    `atexit` handlers run, output flushed), without the module teardown that comes after: with
    torch, transformers and hivemind loaded, clearing every module's namespace takes 1.5-2.5 s of
    CPU at each exit of a coordinator (measured here; every run, `status` and `eval` pays it).
    Nothing of ours relies on it: files are closed where they are written."""
    try:
        main()
        code: object = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what `sys.exit("message")` would print
        code = 1
    # What Py_FinalizeEx does first, in its order: join non-daemon threads (after telling thread
    # pools to stop), then run the atexit handlers (logging.shutdown is one).
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)

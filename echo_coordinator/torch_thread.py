"""The one thread all torch work of the coordinator runs on: loading the trainer, steps, exports
of weights, publishing and verification.

The event loop hands work over with `await call(fn, ...)`; a handler thread (verifying a push)
with `run(fn)`, which blocks that thread, never the loop. One thread, always the same: glibc
gives each thread its own malloc arena, and a step on a fresh thread would grow a fresh one to
the step's peak (measured: 3 steps of 24 Sokoban transcripts on 3 threads reached 24 GB).

Jobs run in the order they came, but a job marked `behind` (verifying a new key's batch: keys
are free, and a fresh key can push a lease of random tokens at once) runs only when no other
job waits. A flood of them costs a training step at most the one already running.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self) -> None:
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()  # (behind, order, job)
        self._order = itertools.count()
        # A call is running: after a signal (or an error) the process exits at once rather than
        # wait for it (a trainer rank that died can leave it waiting for ever).
        self.busy = False
        threading.Thread(target=self._work, name="trainer", daemon=True).start()

    def submit(self, fn: Callable[[], T], behind: bool = False) -> Future:
        future: Future = Future()
        self._jobs.put((behind, next(self._order), (fn, future)))
        return future

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the torch thread, awaited from the event loop."""
        return await asyncio.wrap_future(self.submit(lambda: fn(*args)))

    def run(self, fn: Callable[[], T], behind: bool = False) -> T:
        """`fn()` on the torch thread, from another thread (a handler's), which waits for it;
        `behind`: after every other job waiting."""
        return self.submit(fn, behind).result()

    def shutdown(self) -> None:
        """Cancel the jobs that wait; the running one ends on its own."""
        while True:
            try:
                _, _, (_, future) = self._jobs.get_nowait()
            except queue.Empty:
                return
            future.cancel()

    def _work(self) -> None:
        while True:
            _, _, (fn, future) = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            self.busy = True
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the job
                future.set_exception(e)
            finally:
                self.busy = False

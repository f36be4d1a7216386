"""The one thread all torch work of the coordinator runs on: loading the trainer, steps, exports
of weights, publishing and verification.

The event loop hands work over with `await call(fn, ...)`; a handler thread (verifying a push)
with `run(fn)`, which blocks that thread, never the loop. One thread, always the same: glibc
gives each thread its own malloc arena, and a step on a fresh thread would grow a fresh one to
the step's peak (measured: 3 steps of 24 Sokoban transcripts on 3 threads reached 24 GB).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="trainer")
        # A call is running: after a signal (or an error) the process exits at once rather than
        # wait for it (a trainer rank that died can leave it waiting for ever).
        self.busy = False

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the torch thread, awaited from the event loop."""
        def call() -> T:
            self.busy = True
            try:
                return fn(*args)
            finally:
                self.busy = False

        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the torch thread, from another thread (a handler's), which waits for it."""
        return self.executor.submit(fn).result()

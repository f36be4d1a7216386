"""Supervised background work: a failing task ends the process's main work with its name and
cause; backoff doubles up to its cap and starts over after a success; a program run by
`run_and_exit` exits as Python would."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from protocols.supervise import Backoff, BackgroundFailed, Supervisor


def test_backoff_doubles_to_its_cap_and_resets():
    backoff = Backoff(first=0.5, cap=4.0)
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_main_result_comes_back_and_background_work_is_cancelled():
    async def scenario():
        supervisor, ticks = Supervisor(), []

        async def ticker():
            while True:
                ticks.append(1)
                await asyncio.sleep(0.01)

        background = supervisor.start(ticker(), "ticker")

        async def main():
            await asyncio.sleep(0.05)
            return "done"

        assert await supervisor.run(main()) == "done"
        assert background.cancelled() and ticks
    asyncio.run(scenario())


def test_a_failing_background_task_stops_main_with_its_name_and_cause():
    async def scenario():
        supervisor, main_cancelled = Supervisor(), asyncio.Event()

        async def refresh():
            await asyncio.sleep(0.02)
            raise RuntimeError("disk full")

        async def main():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                main_cancelled.set()
                raise

        supervisor.start(refresh(), "dht-refresh")
        with pytest.raises(BackgroundFailed, match="dht-refresh stopped: RuntimeError: disk full"):
            await asyncio.wait_for(supervisor.run(main()), 5)
        assert main_cancelled.is_set()
    asyncio.run(scenario())


def test_a_background_task_that_ends_normally_is_not_a_failure():
    async def scenario():
        supervisor = Supervisor()

        async def once():
            return None

        supervisor.start(once(), "once")

        async def main():
            await asyncio.sleep(0.05)
            return 7

        assert await supervisor.run(main()) == 7
    asyncio.run(scenario())


PROGRAM = """
import atexit, concurrent.futures, sys, threading, time
from protocols.supervise import run_and_exit

def main():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # an idle worker thread: exiting must not wait on it forever
    threading.Thread(target=lambda: (time.sleep(0.3), open(sys.argv[1] + ".thread", "w").close())).start()
    atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").close())
    print("unflushed", end="")
    sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])

run_and_exit(main)
"""


@pytest.mark.parametrize("exit_with, code", [("0", 0), ("3", 3), ("a message", 1)])
def test_run_and_exit_exits_as_python_would(tmp_path, exit_with, code):
    """Skipping the module teardown keeps what an exit promises: the code, flushed output, the
    non-daemon threads finished, the atexit handlers run (and thread pools do not hang it)."""
    mark = tmp_path / "mark"
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(mark), exit_with], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[3])
    assert done.returncode == code and done.stdout == "unflushed"
    assert done.stderr.strip() == ("a message" if code == 1 else "")
    assert (tmp_path / "mark.thread").exists() and (tmp_path / "mark.atexit").exists()

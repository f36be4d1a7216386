"""Where a process spends its CPU, by component: a sampling profiler for bench/swarm_scale.py.

Every `interval` seconds it reads each thread's CPU time since its last look (utime + stime in
/proc/self/task/<tid>/stat) and charges it to the component of the code that thread is running
then (its innermost frame whose file names one, `COMPONENTS`). A thread that waits costs nothing,
so idle pools, the event loop's select and lock waits are never charged. Coarse (the kernel counts
CPU in 10 ms ticks) but unbiased over a run of minutes. Child processes (hivemind's DHT process,
the p2pd daemons) are charged whole, by what they are (`children`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

import psutil

TICK = os.sysconf("SC_CLK_TCK")
# Innermost matching frame wins: a signature check called from the push path is "signatures".
COMPONENTS = (
    ("signatures", ("protocols/signing", "/cryptography/")),
    ("verification", ("echo_coordinator/verify", "protocols/sampling", "engines/sampler", "support/live_service")),
    ("ledger and journal", ("echo_coordinator/ledger", "echo_coordinator/journal", "trainer/samples")),
    ("lease book", ("protocols/leases", "service/leasing", "service/registry", "service/evaluating")),
    ("decoding", ("protocols/wire", "protocols/messages", "/msgpack/")),
    ("publishing", ("echo_coordinator/publish", "transport/relay", "protocols/chunks", "protocols/delta",
                    "protocols/uploads")),
    ("presence and DHT", ("echo_coordinator/presence", "transport/dht", "hivemind/dht")),
    ("judging", ("service/pushes", "service/judging", "service/policing", "service/buffer", "protocols/sync",
                 "engines/episodes", "/tasks/")),
    ("transport", ("transport/streams", "/hivemind/", "/asyncio/", "echo_coordinator/handlers", "/concurrent/")),
)


def component(frame) -> str:
    while frame is not None:
        path = frame.f_code.co_filename
        for name, marks in COMPONENTS:
            if any(m in path for m in marks):
                return name
        frame = frame.f_back
    return "other"


def thread_cpu(native_id: int) -> float:
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # the thread ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat)


class CpuSplit:
    """`split = CpuSplit().start()`; `split.seconds` is CPU seconds per component so far (the
    profiler's own under "profiler": subtract it from the process's CPU time)."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.seconds: Counter[str] = Counter()
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-split", daemon=True)

    def start(self) -> CpuSplit:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        self.seconds.clear()

    def _run(self) -> None:
        me = threading.get_native_id()
        while not self._stop.wait(self.interval):
            frames = sys._current_frames()
            for thread in threading.enumerate():
                tid = thread.native_id
                if tid is None or tid == me or thread.ident not in frames:
                    continue
                used = thread_cpu(tid)
                spent, self._last[tid] = used - self._last.get(tid, used), used
                if spent > 0:
                    self.seconds[component(frames[thread.ident])] += spent
            used = thread_cpu(me)
            self.seconds["profiler"] += used - self._last.get(me, used)
            self._last[me] = used


def native_threads() -> dict[str, float]:
    """CPU seconds so far of this process's threads that Python did not start (numba's, OpenMP's,
    BLAS's, sqlite's, torch's), by name: what `CpuSplit` cannot charge to a component."""
    ours = {t.native_id for t in threading.enumerate()}
    out: Counter[str] = Counter()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in ours:
            try:
                out[open(f"/proc/self/task/{tid}/comm").read().strip()] += thread_cpu(int(tid))
            except OSError:
                continue
    return dict(out)


def children() -> dict[str, float]:
    """CPU seconds of this process's descendants so far, by what they are."""
    out: Counter[str] = Counter()
    for child in psutil.Process().children(recursive=True):
        try:
            times, cmd = child.cpu_times(), " ".join(child.cmdline())
        except psutil.Error:
            continue
        out["transport (p2pd)" if "p2pd" in cmd else "presence and DHT"] += times.user + times.system
    return dict(out)


def own_cpu() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def pinned(cpus: set[int] | None):
    """A `preexec_fn` that keeps a child process (and what it starts) on `cpus`; None: anywhere."""
    return None if cpus is None else lambda: os.sched_setaffinity(0, cpus)

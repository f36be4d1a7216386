"""The process llama.cpp's worker runs in (`engines.llama_worker`), apart from what is said to it:
how it is started (with what of the node's environment), how much memory it holds of its own,
and how it is ended. `engines.llama_process` talks to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from engines.sandbox import NODE_CWD

WORKER = "engines.llama_worker"  # the module a worker runs

# What the worker inherits of the node's environment (which may hold the volunteer's secrets):
# where to find programs and libraries, and the settings of the libraries it runs.
ENVIRONMENT = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
ENVIRONMENT_PREFIXES = ("LC_", "GGML_", "LLAMA_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "HSA_", "VK_", "MESA_",
                        "OMP_", "OPENBLAS_", "MKL_", "NUMBA_", "KMP_")


def own_memory(pid: int) -> int:
    """Bytes a process holds of its own: resident anonymous pages and swap (Linux; 0 where /proc
    cannot say). A mapped model file is not counted: the kernel can always drop its pages."""
    held = 0
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(("RssAnon:", "VmSwap:")):
                    held += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return held


def worker_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in ENVIRONMENT or k.startswith(ENVIRONMENT_PREFIXES)}


class Spawned:
    """A worker process started before its model is known: it imports and compiles meanwhile
    (most of its start), then waits to be told what to load. A node starts one before it joins
    the swarm and hands it to `LlamaProcess`; one never handed over ends at `close`, or when
    the node exits (its socket closes)."""

    def __init__(self, module: str = WORKER):
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-P", "-m", module, str(theirs.fileno())]
        # Its own process group, so that a kill takes whatever it started. GGML_NO_BACKTRACE: on an
        # abort ggml forks a debugger to print a backtrace (one was seen spinning for 10 minutes).
        self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                        cwd="/", start_new_session=True,  # cwd: not the volunteer's directory
                                        env=dict(worker_environment(), GGML_NO_BACKTRACE="1", OPENBLAS_NUM_THREADS="1",
                                                 **{NODE_CWD: os.getcwd()}))  # (never granted: engines.sandbox)
        theirs.close()
        self.conn = Connection(ours.detach())

    def kill(self) -> int:
        """The worker and whatever it started killed; its exit code."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # every process of the group has exited and been reaped
        return self.process.wait()

    def close(self) -> None:
        if self.process.poll() is None:
            self.conn.close()
            self.kill()

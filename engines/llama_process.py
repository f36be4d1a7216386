"""llama.cpp in a worker process: the node's `Backend` when it generates with llama.cpp.

The worker (`engines.llama_worker`) holds an `engines.llama_backend.LlamaBackend`, confined
(`engines.sandbox`). What it sends back is checked like any untrusted input (a worker whose
parser was subverted is no longer ours): completions must fit their requests and the model's
vocabulary, logprobs must be finite log-probabilities.

A worker that dies (llama.cpp aborting on a file or in a kernel) is started again as it was (the
weights and adapter it last served without failing) and the call that killed it fails:
`set_adapter` and `load_weights` with a ValueError (an update the node cannot use), `generate`
with `BackendCrashed` (the round is tried again). It costs a model load, not the node.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from engines.backend import DEFAULT_PARALLEL, BackendCrashed, Completion, Follow, Interrupted, Request
from engines.full_weights import file_type
from engines.gguf_io import FILE_TYPES, Layout, write_model
from engines.hf import load_config, load_master
from engines.llama_device import CPU_SETTINGS, DeviceError, context_bytes
from engines.sandbox import SandboxError
from engines.llama_worker import MAX_MESSAGE_BYTES, wire_request
from engines.worker_process import WORKER, Spawned, own_memory

POLL_SECONDS = 0.1  # how soon a stop reaches a generation in the worker
EXIT_SECONDS = 2.0  # a worker whose socket closed has that long to exit before it is killed
MAX_LOGPROB = 1e-6  # a log-softmax is at most 0; rounding may leave it a hair above


def plain(text, limit: int = 2000) -> str:
    """What a worker said, as printable text of bounded length (no terminal escapes)."""
    return "".join(c for c in str(text)[:limit] if c.isprintable())


def memory_cap(layout: Layout, file_bytes: int, parallel: int, window: int) -> int:
    """The most memory of its own (`own_memory`) the worker may hold before the node ends it:
    twice what the whole model takes on the CPU (its weights, were they copied; a float32 KV
    cache of `parallel` windows; attention scores of a 512-token step), and 1 GiB for Python and
    a GPU driver's own. On a GPU backend the device's memory is not the process's, except where
    it is host memory (lavapipe), which the cap then covers. Honest workers held 0.10-0.26 of
    the cap on the CPU (SmolLM2-135M Q4_1, 1-32 sequences of 256-2048 tokens) and 0.33 on
    Vulkan's lavapipe (docs/volunteers.md)."""
    kv_width = 2 * layout.n_head_kv * (layout.n_embd // max(layout.n_head, 1))
    kv, scores = context_bytes(layout.n_layers, parallel * window, kv_width, layout.n_head, CPU_SETTINGS)
    # The header is the coordinator's: however large a model it claims, the cap stays within this
    # machine's memory (else a crafted header would lift it; issue 55 point 11).
    return min(2 * (file_bytes + kv + scores) + 2**30, physical_memory())


def physical_memory() -> int:
    """Bytes of memory this machine has (no bound where the system cannot say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 62


class LlamaProcess:
    name = "llama_cpp"
    WORKER = WORKER  # the module the worker runs (a test's subclass runs another)

    def __init__(self, model_path: Path, threads: int = 0, n_ctx: int = 2048, interrupt: threading.Event | None = None,
                 readable: tuple[Path, ...] = (), writable: tuple[Path, ...] = (), confine: bool = True,
                 max_memory: int | None = None, spawned: Spawned | None = None, **options):
        """`LlamaBackend`'s arguments (`options`: its keywords), in a worker that may read only
        the model file and beneath `readable`, and write only beneath `writable` (directories,
        made here if missing). `confine`: False runs it unconfined, for a system where the
        sandbox keeps llama.cpp from working. A worker holding more than `max_memory` bytes of
        its own (default `memory_cap`) is ended like one that crashed. `spawned`: the worker to
        use first (a restart starts its own)."""
        self.model_path = Path(model_path).absolute()  # the worker runs in /
        self.n_ctx, self.interrupt = n_ctx, interrupt or threading.Event()
        self.layout = Layout.of_file(self.model_path)  # read by our parser, before llama.cpp sees the file
        self.max_memory = max_memory or memory_cap(self.layout, self.model_path.stat().st_size,
                                                   options.get("parallel", DEFAULT_PARALLEL), n_ctx)
        self.file_type = file_type(self.model_path)
        for directory in (*readable, *writable):
            directory.mkdir(parents=True, exist_ok=True)  # Landlock grants paths that exist
        self._options = dict(options, threads=threads, n_ctx=n_ctx, confine=confine,
                             readable=[str(p.absolute()) for p in (self.model_path, *readable)],
                             writable=[str(p.absolute()) for p in writable])
        self._serving, self._adapter = self.model_path, None  # what a restarted worker loads
        self._lock = threading.RLock()  # one exchange at a time; `follow` may tokenize within one
        self._rate = 0.0
        self._worker = spawned
        ready = self._start()
        counts = [ready.get(k) if isinstance(ready, dict) else None for k in ("eos", "vocab_size", "parallel", "n_params")]
        if not all(type(n) is int and n >= 0 for n in counts) or not counts[1] or not counts[2]:
            raise self._died("loading the model (it described the model in no numbers)", broke=True)
        self.eos, self.vocab_size, self.parallel, self.n_params = counts
        # Printed on the volunteer's console and announced: as plain text, whatever the worker sent.
        self.hardware, self.fitted = plain(ready.get("hardware")), ready.get("fitted") and plain(ready["fitted"])
        self.confined = plain(ready.get("confined")) if ready.get("confined") else "not confined (--no-sandbox)"

    # -- the worker's life

    @property
    def _process(self) -> subprocess.Popen:
        return self._worker.process

    @property
    def _conn(self) -> Connection:
        return self._worker.conn

    def _start(self) -> dict:
        if self._worker is None or self._worker.process.poll() is not None:
            self._worker = Spawned(self.WORKER)
        self._send(dict(self._options, model=str(self._serving)))
        ready = self._receive("loading the model")
        if self._adapter is not None:
            self._send({"op": "set_adapter", "path": str(self._adapter.absolute())})
            self._receive(f"loading adapter {self._adapter}")
        return ready

    def _died(self, doing: str, broke: bool = False) -> BackendCrashed:
        """The worker is gone, or (`broke`) broke its protocol and is ended: what happened."""
        self._conn.close()
        if not broke:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(EXIT_SECONDS)  # its socket closed as it died: let it finish dying
        alive = self._process.poll() is None
        code = self._worker.kill()
        how = ("was ended by the node" if alive else f"crashed ({signal.Signals(-code).name})" if code < 0
               else f"exited with code {code}")
        return BackendCrashed(f"llama.cpp's worker process {how} while {doing}")

    def _restart(self, error: BackendCrashed) -> BackendCrashed:
        """A worker in place of the one that died (none is started while one runs), and `error`."""
        if self._process.poll() is None:
            return error
        try:
            self._start()
        except BackendCrashed as again:
            raise BackendCrashed(f"{error}; restarting it failed too: {again}") from None
        return error

    def close(self) -> None:
        with self._lock:
            self._worker.close()

    # -- one exchange

    def _send(self, message: dict) -> None:
        try:
            self._conn.send_bytes(json.dumps(message).encode())
        except OSError:
            raise self._died(f"being sent {message.get('op', 'its options')}") from None

    def _receive(self, doing: str, interruptible: bool = False):
        """The worker's next message: an answer's value, or a `follow` message as it is."""
        signalled = False
        try:
            while True:
                # Checked before each wait, so a stop set by `follow` reaches the worker at once.
                if interruptible and self.interrupt.is_set() and not signalled:
                    os.kill(self._process.pid, signal.SIGUSR1)
                    signalled = True
                if self._conn.poll(POLL_SECONDS):
                    break
                if self._process.poll() is not None:  # dead, though a child of it may hold the socket open
                    raise EOFError
                if (held := own_memory(self._process.pid)) > self.max_memory:
                    raise self._died(f"{doing} (it held {held / 2**20:,.0f} MiB, over its cap of "
                                     f"{self.max_memory / 2**20:,.0f} MiB)", broke=True)
            message = json.loads(self._conn.recv_bytes(MAX_MESSAGE_BYTES))
        except (EOFError, OSError):  # OSError: also a message past MAX_MESSAGE_BYTES
            raise self._died(doing) from None
        except ValueError:
            raise self._died(f"{doing} (it sent no JSON)", broke=True) from None
        if not isinstance(message, dict):
            raise self._died(f"{doing} (it sent {type(message).__name__})", broke=True)
        if "follow" in message:
            return message
        if "error" in message:
            kind, text = message.get("kind"), plain(message["error"])
            raised = {"interrupted": Interrupted, "device": DeviceError, "sandbox": SandboxError}.get(kind, ValueError)
            raise raised(text)
        return message.get("ok")

    def _call(self, op: str, doing: str, **arguments):
        """One request's answer; a worker that dies doing it is restarted (`BackendCrashed`)."""
        with self._lock:
            try:
                self._send(dict(arguments, op=op))
                return self._receive(doing)
            except BackendCrashed as e:
                raise self._restart(e) from None

    # -- the Backend protocol

    def generate(self, requests: list[Request], temperature: float, follow: Follow | None = None) -> list[Completion]:
        """`engines.backend.Backend.generate`, in the worker; a worker that dies fails it with
        `BackendCrashed`, restarted."""
        if self.interrupt.is_set():
            raise Interrupted("stopping")
        current = list(requests)  # what each sequence asks now: its completion must fit it
        with self._lock:
            try:
                self._send({"op": "generate", "requests": [wire_request(r) for r in requests],
                            "temperature": temperature, "follow": follow is not None})
                while "follow" in (reply := self._receive("generating", interruptible=True)):
                    index = self._index(reply.get("follow"), current)
                    following = self._following(follow, index, self._completion(reply.get("completion"), current[index]))
                    if following is not None:
                        current[index] = following
                    self._send({"op": "followed", "request": None if following is None else wire_request(following)})
                completions = reply.get("completions") if isinstance(reply, dict) else None
                if not isinstance(completions, list) or len(completions) != len(current):
                    raise self._died("generating (it sent a malformed answer)", broke=True)
                self._rate = float(reply.get("rate", 0.0))
                return [self._completion(c, r) for c, r in zip(completions, current)]
            except BackendCrashed as e:
                raise self._restart(e) from None

    def _following(self, follow: Follow, index: int, done: Completion) -> Request | None:
        """`follow`'s answer; when it raises, the worker drops the batch before the error goes on."""
        try:
            return follow(index, done)
        except BackendCrashed:
            raise
        except BaseException:
            self._send({"op": "followed", "abort": True})
            try:
                self._receive("dropping the batch")
            except Interrupted:
                pass  # the answer expected: the worker is ready for the next request
            raise

    def _index(self, index, current: list[Request]) -> int:
        if type(index) is not int or not 0 <= index < len(current):
            raise self._died("generating (it named no sequence of the batch)", broke=True)
        return index

    def _completion(self, wire, request: Request) -> Completion:
        """A completion the worker sent, held to its request: at most `max_new_tokens` ids of the
        vocabulary, one finite log-probability each."""
        try:
            ids, logprobs = wire
            ok = (isinstance(ids, list) and isinstance(logprobs, list) and len(ids) == len(logprobs)
                  and len(ids) <= request.max_new_tokens
                  and all(type(t) is int and 0 <= t < self.vocab_size for t in ids)
                  and all(type(p) is float and math.isfinite(p) and p <= MAX_LOGPROB for p in logprobs))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise self._died("generating (it sent a completion that does not fit its request)", broke=True)
        return Completion(tuple(ids), tuple(logprobs))

    def tokenize(self, text: str) -> list[int]:
        ids = self._call("tokenize", "tokenizing", text=text)
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < self.vocab_size for t in ids):
            raise self._restart(self._died("tokenizing (it sent ids outside the vocabulary)", broke=True))
        return ids

    def detokenize(self, ids: tuple[int, ...]) -> str:
        text = self._call("detokenize", "detokenizing", ids=list(ids))
        if not isinstance(text, str):
            raise self._restart(self._died("detokenizing (it sent no text)", broke=True))
        return text

    @property
    def throughput(self) -> float:
        return self._rate

    def set_adapter(self, path: Path | None) -> None:
        """Serve with this GGUF adapter (None: the base alone). A file llama.cpp refuses, or dies
        on (loading it or at its first decode), changes nothing: a ValueError."""
        with self._lock:
            try:
                self._call("set_adapter", f"loading adapter {path}", path=None if path is None else str(path.absolute()))
            except BackendCrashed as e:
                raise ValueError(str(e)) from None
            self._adapter = path

    def base_weights(self):
        return load_master(self.model_path)

    def load_weights(self, master: dict[str, np.ndarray], version: int, workdir: Path) -> None:
        """Full mode: `master` written as GGUF here (our writer), requantized to the joined file's
        type and loaded by the worker (which may write only beneath `workdir`); older exports go."""
        if self._adapter is not None:
            raise ValueError("a LoRA adapter is active; full-mode reloads do not combine with adapters")
        workdir.mkdir(parents=True, exist_ok=True)
        workdir = workdir.absolute()
        out, f32 = workdir / f"v{version}.gguf", workdir / f"v{version}.f32.gguf"
        write_model(load_config(self.model_path), master, f32, tokenizer=self.model_path)
        with self._lock:
            try:
                if self.file_type == FILE_TYPES["f32"]:
                    f32.replace(out)
                else:
                    self._call("quantize", f"requantizing version {version}", source=str(f32), out=str(out),
                               ftype=self.file_type)
                self._call("reload", f"loading version {version}", path=str(out))
            except BackendCrashed as e:
                out.unlink(missing_ok=True)
                raise ValueError(str(e)) from None
            finally:
                f32.unlink(missing_ok=True)
            self._serving = out
        for old in workdir.glob("v*.gguf"):
            if old != out:
                old.unlink()

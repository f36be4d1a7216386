"""The process a node's llama.cpp runs in (`engines.llama_process` starts it and talks to it).

    python -P -m engines.llama_worker FD

llama.cpp parses files a coordinator chose (the base model, adapters, full-mode exports). A crash
in it, or a parser bug, ends this process, not the node; and it runs confined (`engines.sandbox`)
before the first of those files is opened. Over FD (a unix socket) come JSON objects, one a
message: first the `LlamaBackend` options and the paths it may read and write, then one request
at a time (`{"op": ..., ...}`), each answered `{"ok": value}` or `{"error": text, "kind": k}`.
While `generate` runs, a sequence whose turn ended is sent as `{"follow": index, "completion":
[ids, logprobs]}`; the node answers `{"op": "followed", "request": ...}`, and may ask `tokenize`
or `detokenize` before it does. SIGUSR1 interrupts a generation (the node stopping).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

MAX_MESSAGE_BYTES = 64 * 2**20  # a request from the node: prompts of a lease


def wire_completion(c) -> list:
    return [list(c.token_ids), list(c.logprobs)]


def wire_request(r) -> list:
    return [list(r.prompt_ids), r.max_new_tokens, r.seed, r.offset]


ORPHAN_POLL = 0.5  # seconds between looks at whether the node is still there


def _die_with(parent: int) -> None:
    """End this process once the node that started it is gone (killed, say, mid-lease), not when
    a generation it no longer wants is done: a busy orphan would hold the CPU meanwhile."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL)
    os._exit(0)


def main() -> None:
    parent = os.getppid()
    conn = Connection(int(sys.argv[1]))
    # Imports and numba's compile first, the options after: a node starts its worker before it
    # joins (`worker_process.Spawned`), so that this part overlaps the join.
    import numpy as np

    from engines import sandbox
    from engines.backend import Interrupted, Request
    from engines.gguf_io import quantize
    from engines.llama_backend import LlamaBackend
    from engines.llama_device import DeviceError
    from engines.sampler import sample_rows, use_threads

    def send(message: dict) -> None:
        conn.send_bytes(json.dumps(message).encode())

    def receive() -> dict:
        return json.loads(conn.recv_bytes(MAX_MESSAGE_BYTES))

    # Compiled (or read from numba's cache) before confining: the cache's directory is not writable
    # after. On one thread: Landlock confines only the thread that asks, so no other thread may
    # exist then (`sandbox.confine` checks); numba's start once the backend calls it, confined.
    use_threads(1)
    for seed in (1, None):
        sample_rows(np.zeros((1, 8), np.float32), 1.0, [seed], [0])
    try:
        options = json.loads(conn.recv_bytes(MAX_MESSAGE_BYTES))
    except EOFError:  # a node that never needed it (refused to join, say)
        return
    confined = []
    readable, writable = [Path(p) for p in options.pop("readable")], [Path(p) for p in options.pop("writable")]
    if options.pop("confine"):
        options["confine"] = lambda: confined.append(sandbox.confine(readable, writable))
    backend = None

    def request(wire: list) -> Request:
        return Request(tuple(wire[0]), wire[1], wire[2], wire[3])

    def follow(index: int, completion) -> Request | None:
        send({"follow": index, "completion": wire_completion(completion)})
        while (message := receive())["op"] != "followed":
            serve(message)  # the node's follow may tokenize and detokenize first
        if message.get("abort"):
            raise Interrupted("the node ended the generation")  # its follow failed: the batch is dropped
        return None if message["request"] is None else request(message["request"])

    def answer(message: dict):
        op = message["op"]
        if op == "generate":
            done = backend.generate([request(r) for r in message["requests"]], message["temperature"],
                                    follow if message["follow"] else None)
            return {"completions": [wire_completion(c) for c in done], "rate": backend.throughput}
        if op == "tokenize":
            return backend.tokenize(message["text"])
        if op == "detokenize":
            return backend.detokenize(tuple(message["ids"]))
        if op == "set_adapter":
            backend.set_adapter(None if message["path"] is None else Path(message["path"]))
            # An adapter llama.cpp accepts can still abort it at the first decode: found here, not mid-lease.
            backend.generate([Request((backend.eos,), 1, None)], 1.0)
            return None
        if op == "quantize":
            quantize(Path(message["source"]), Path(message["out"]), message["ftype"])
            return None
        if op == "reload":
            backend.reload(Path(message["path"]))
            return None
        raise ValueError(f"unknown request {op!r}")

    def serve(message: dict) -> None:
        try:
            send({"ok": answer(message)})
        except Interrupted as e:
            send({"error": str(e), "kind": "interrupted"})
        except DeviceError as e:
            send({"error": str(e), "kind": "device"})
        except (ValueError, RuntimeError, OSError) as e:  # a file or a batch llama.cpp refused
            send({"error": str(e), "kind": "value"})

    try:
        backend = LlamaBackend(Path(options.pop("model")), **options)
    except DeviceError as e:
        send({"error": str(e), "kind": "device"})
        return
    except sandbox.SandboxError as e:  # not confined where it must be: llama.cpp never opened the model
        send({"error": str(e), "kind": "sandbox"})
        return
    except (ValueError, RuntimeError, OSError) as e:
        send({"error": str(e), "kind": "value"})
        return
    threading.Thread(target=_die_with, args=(parent,), daemon=True, name="orphan-watch").start()  # confined too
    signal.signal(signal.SIGUSR1, lambda *_: backend.interrupt.set())
    send({"ok": {"hardware": backend.hardware, "eos": backend.eos, "vocab_size": backend.vocab_size,
                 "parallel": backend.parallel, "n_params": backend.n_params, "fitted": backend.fitted,
                 "confined": confined[0] if confined else None}})
    while True:
        try:
            message = receive()
        except EOFError:  # the node is gone
            return
        backend.interrupt.clear()
        serve(message)


if __name__ == "__main__":
    main()

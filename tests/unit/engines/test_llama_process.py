"""llama.cpp in its worker process (`engines.llama_process`): the same samples as in-process, a
crash in llama.cpp costs a restart and not the node, and a worker's answers are held to their
requests like any untrusted input."""

import os
import subprocess
import sys
import signal
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from engines.backend import BackendCrashed, Interrupted, Request
from engines.llama_backend import LlamaBackend
from engines.gguf_io import Layout
from engines.llama_process import LlamaProcess, memory_cap
from engines.worker_process import Spawned, own_memory
from tests.support.hostile_worker import ANSWERS
from tests.support.tiny_model import build_tiny_gguf
from tests.unit.engines.test_sandbox import landlock_abi


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf")


@pytest.fixture
def worker(model, tmp_path):
    process = LlamaProcess(model, threads=1, n_ctx=128, parallel=2, readable=(tmp_path,))
    yield process
    process.close()


def adapter(path, layout, a_shape, seed=0):
    """A LoRA adapter of attn_q in layer 0, written directly (no shape check): A of `a_shape`,
    B of rank `a_shape[-2]`, which llama.cpp checks A against."""
    rng = np.random.default_rng(seed)
    out_dim = layout.shapes["blk.0.attn_q.weight"][0]
    writer = gguf.GGUFWriter(str(path), arch=layout.arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 4.0)
    writer.add_tensor("blk.0.attn_q.weight.lora_a", rng.normal(0, 1, a_shape).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight.lora_b", rng.normal(0, 1, (out_dim, a_shape[-2])).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


REQUESTS = [Request((1, 400, 401, 402), 12, seed) for seed in (3, 4, 5)]


def test_the_worker_samples_what_the_backend_samples_turn_by_turn(model, worker):
    """Three sequences on two slots, each continued once by a follow that tokenizes (a nested
    request to the worker while its generation waits for the answer)."""
    here = LlamaBackend(model, threads=1, n_ctx=128, parallel=2)
    assert worker.confined.startswith(f"landlock ABI {landlock_abi()}") if landlock_abi() > 0 else True

    def follow(backend, turns):
        def after(index, done):
            turns.append((index, done))
            if len([i for i, _ in turns if i == index]) > 1:
                return None
            reply = backend.tokenize(f"reply {backend.detokenize(done.token_ids[:2])}")
            return Request(REQUESTS[index].prompt_ids + done.token_ids + tuple(reply), 6, 7 + index, len(done.token_ids))
        return after

    ours, theirs = [], []
    assert worker.generate(REQUESTS, 0.9, follow(worker, ours)) == here.generate(REQUESTS, 0.9, follow(here, theirs))
    assert ours == theirs and len(ours) == 6
    assert worker.throughput > 0 and worker.vocab_size == here.vocab_size and worker.eos == here.eos


def test_a_worker_started_ahead_is_the_one_used_and_one_never_used_ends(model):
    """A node starts its worker before it joins (`Spawned`: imports meanwhile, then waits for
    its model); the backend adopts it. One never handed over (a refused join) ends at `close`,
    and by itself once the node's end of its socket closes (the node exiting)."""
    ahead = Spawned()
    worker = LlamaProcess(model, threads=1, n_ctx=128, parallel=2, spawned=ahead)
    try:
        assert worker._process is ahead.process and len(worker.generate(REQUESTS, 0.9)) == 3
    finally:
        worker.close()
    assert ahead.process.poll() is not None
    unused = Spawned()
    unused.conn.close()
    assert unused.process.wait(timeout=60) == 0
    closed = Spawned()
    closed.close()
    assert closed.process.poll() == -signal.SIGKILL


def test_an_adapter_that_aborts_llama_cpp_costs_a_restart_not_the_node(worker, tmp_path):
    """A 3-D lora_a for a matrix: llama.cpp loads it and aborts at its first decode
    (`GGML_ASSERT(ggml_can_mul_mat)`), which killed the node and every restart of it."""
    good = adapter(tmp_path / "good.gguf", worker.layout, (2, worker.layout.n_embd))
    worker.set_adapter(good)
    with_good = worker.generate(REQUESTS, 0.9)
    before = worker._process.pid
    bad = adapter(tmp_path / "bad.gguf", worker.layout, (2, 1, worker.layout.n_embd), seed=1)
    with pytest.raises(ValueError, match=r"worker process crashed \(SIGABRT\) while loading adapter .*bad.gguf"):
        worker.set_adapter(bad)
    assert worker._process.pid != before  # a new worker ...
    assert worker.generate(REQUESTS, 0.9) == with_good  # ... serving the adapter that worked


def test_a_worker_killed_mid_generation_fails_that_call_only(worker):
    alone = worker.generate(REQUESTS, 0.9)

    def kill(index, done):  # the worker waits for this answer mid-batch: killed then, not after a guessed time
        os.kill(worker._process.pid, signal.SIGKILL)
        return None
    with pytest.raises(BackendCrashed, match=r"crashed \(SIGKILL\) while generating"):
        worker.generate(REQUESTS, 0.9, kill)
    assert worker.generate(REQUESTS, 0.9) == alone


def test_a_follow_that_fails_drops_the_batch_and_keeps_the_worker(worker):
    alone = worker.generate(REQUESTS, 0.9)
    pid = worker._process.pid

    def broken(index, done):
        raise KeyError("the environment failed")

    with pytest.raises(KeyError, match="the environment failed"):
        worker.generate(REQUESTS, 0.9, broken)
    assert worker._process.pid == pid and worker.generate(REQUESTS, 0.9) == alone


def test_a_stop_reaches_the_generation_in_the_worker(model):
    """The stop comes as the batch's 1-token sequence ends, while the others (2000 tokens each,
    seconds of work) are certainly mid-generation: none of them ends, the call is interrupted."""
    worker = LlamaProcess(model, threads=1, n_ctx=2048, parallel=2)
    ended = []

    def stop(index, done):
        ended.append(index)
        worker.interrupt.set()
        return None

    try:
        batch = [Request((1, 400), 1, 0)] + [Request((1, 400), 2000, seed) for seed in range(1, 5)]
        with pytest.raises(Interrupted):
            worker.generate(batch, 0.9, stop)
        assert ended == [0]
        with pytest.raises(Interrupted):  # stopping is for good: nothing more is generated
            worker.generate(REQUESTS, 0.9)
        worker.interrupt.clear()
        assert len(worker.generate(REQUESTS, 0.9)) == 3
    finally:
        worker.close()


class Hostile(LlamaProcess):
    WORKER = "tests.support.hostile_worker"


@pytest.mark.parametrize("mode", [*ANSWERS, "not json"])
def test_a_worker_answer_that_does_not_fit_its_request_is_refused_and_the_worker_replaced(model, mode, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[3]))  # the worker runs in /: `tests` from here
    worker = Hostile(model, confine=False, mode=mode)
    try:
        first = worker._process.pid
        with pytest.raises(BackendCrashed, match="while generating"):
            worker.generate([Request((1, 2), 4, 1)], 1.0, lambda i, done: None)
        assert worker._process.pid != first and worker._process.poll() is None
        assert worker.hardware == "hostile ]52;c;ZWNobyBldmls"  # no terminal escape reaches the console
        with pytest.raises(ValueError, match=r"^\[2Jrefused$"):
            worker.tokenize("x")
    finally:
        worker.close()


def test_a_worker_holding_more_memory_than_its_cap_is_ended_and_replaced(model, monkeypatch):
    """Issue 36 point 7: llama.cpp parses the coordinator's files in the worker, and a parser that
    allocates without end must not take the volunteer's machine. The node reads the worker's own
    memory while it waits for an answer and ends it past its cap; the call fails as a crash does."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[3]))
    worker = Hostile(model, confine=False, mode="runaway memory", max_memory=512 * 2**20)
    try:
        first, started = worker._process.pid, time.monotonic()
        with pytest.raises(BackendCrashed, match=r"ended by the node while generating \(it held [\d,]+ MiB, "
                                                 r"over its cap of 512 MiB\)"):
            worker.generate([Request((1, 2), 4, 1)], 1.0)
        assert time.monotonic() - started < 10
        assert worker._process.pid != first and worker._process.poll() is None
    finally:
        worker.close()


def test_an_honest_worker_holds_under_half_its_default_memory_cap(model, worker):
    """docs/volunteers.md has the shares measured on SmolLM2: 0.10-0.26 of the cap on the CPU, 0.33 on lavapipe."""
    worker.generate(REQUESTS, 0.9)
    assert worker.max_memory == memory_cap(worker.layout, model.stat().st_size, 2, 128)
    assert 0 < own_memory(worker._process.pid) < worker.max_memory / 2


def test_a_worker_whose_node_is_killed_mid_generation_stops_at_once(model, tmp_path):
    """A node killed mid-lease (SIGKILL: nothing of it runs) must not leave its worker generating.
    The node says when its worker generates: once it has answered the follow of the batch's
    1-token sequence (not while the worker waits for that answer, when the closed socket would
    end it), with eight sequences of 2000 tokens (~20 s of work) still to go."""
    script = ("from engines.llama_process import LlamaProcess; from engines.backend import Request\n"
              f"w = LlamaProcess({str(model)!r}, threads=1, n_ctx=2048, parallel=2)\n"
              "print(w._process.pid, flush=True)\n"
              "send = w._send\n"
              "def answer(message):\n"
              "    send(message)\n"
              "    if message.get('op') == 'followed':\n"
              "        print('generating', flush=True)\n"
              "w._send = answer\n"
              "w.generate([Request((1, 400), 1, 0)] + [Request((1, 400), 2000, s) for s in range(1, 9)], 0.9,\n"
              "           lambda index, done: None)\n")
    node = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(node.stdout.readline())
    assert node.stdout.readline() == "generating\n"
    node.kill()
    node.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")


def test_a_header_that_claims_a_huge_model_does_not_lift_the_cap_past_this_machines_memory(model):
    """The memory cap is computed from the coordinator's GGUF header (layers, heads, width): one
    that claims a thousand 64k-wide layers must not buy its worker all of the machine's memory and
    more (issue 55 point 11)."""
    from dataclasses import replace

    from engines.llama_process import physical_memory

    claimed = replace(Layout.of_file(model), n_layers=1000, n_embd=65536, n_head=64, n_head_kv=64)
    assert memory_cap(claimed, model.stat().st_size, 32, 4096) == physical_memory() < 2**50


class Threaded(LlamaProcess):
    WORKER = "tests.support.threaded_worker"


@pytest.mark.skipif(landlock_abi() < 1 if sys.platform.startswith("linux") else True, reason="needs Landlock")
def test_a_worker_that_cannot_be_confined_never_loads_the_model_and_says_how_to_opt_out(model, monkeypatch):
    """The sandbox fails closed (issue 55 point 6): a worker with a thread Landlock would miss
    does not load the coordinator's file; the node gets a SandboxError (an OSError: `echo-node`
    prints it and exits) that names --no-sandbox, the explicit way to run unconfined."""
    from engines.sandbox import SandboxError

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[3]))  # the worker runs in /: `tests` from here
    with pytest.raises(SandboxError, match=r"1 other threads ran before it could be confined: \w+\); "
                                           r"--no-sandbox runs llama.cpp unconfined"):
        Threaded(model, threads=1, n_ctx=128, parallel=1)
    worker = Threaded(model, threads=1, n_ctx=128, parallel=1, confine=False)  # opted out: it runs
    try:
        assert worker.confined == "not confined (--no-sandbox)" and len(worker.generate(REQUESTS[:1], 0.9)) == 1
    finally:
        worker.close()

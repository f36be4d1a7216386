"""The torch thread: one thread for every torch job, in the order they came, but a job marked
`behind` (verifying a new key's batch) runs only when no other job waits (issue 36 point 3)."""

import threading

import pytest

from echo_coordinator.torch_thread import TorchThread


def test_jobs_marked_behind_wait_for_every_other_job():
    torch, order, hold, running = TorchThread(), [], threading.Event(), threading.Event()
    first = torch.submit(lambda: running.set() or hold.wait(10))
    assert running.wait(10)
    new_keys = [torch.submit(lambda i=i: order.append(f"new key {i}"), behind=True) for i in range(3)]
    step = torch.submit(lambda: order.append("step"))
    hold.set()
    for job in (first, step, *new_keys):
        job.result(10)
    assert order == ["step", "new key 0", "new key 1", "new key 2"]


def test_one_thread_runs_every_job_and_an_error_reaches_its_caller():
    torch = TorchThread()
    with pytest.raises(ZeroDivisionError):
        torch.run(lambda: 1 / 0)
    assert torch.run(threading.get_ident) == torch.run(threading.get_ident, behind=True) != threading.get_ident()
    assert not torch.busy


def test_waiting_jobs_are_cancelled_at_shutdown():
    torch, hold, running = TorchThread(), threading.Event(), threading.Event()
    first = torch.submit(lambda: running.set() or hold.wait(10))
    assert running.wait(10)
    waiting = torch.submit(lambda: "never")
    torch.shutdown()
    hold.set()
    assert first.result(10) is True and waiting.cancelled()

"""`echo-coordinator` whose every trainer step first sleeps SLOW_STEP_SECONDS, and waits while the
file STEP_GATE exists (at most GATE_SECONDS): a step long enough to be interrupted, or a run held
until a test has seen what it needs (a late node joined), with every other code path the real
coordinator's. Each step first creates the file STEP_STARTED: a test that stops the coordinator
mid-step waits for it, not for a guessed time."""

import os
import time
from pathlib import Path

from echo_coordinator.trainer.learner import Trainer

GATE_SECONDS = 300.0  # a gate nobody opens must not hang the suite

_step = Trainer.step


def _slow_step(self, samples, *args, **kwargs):
    if started := os.environ.get("STEP_STARTED"):
        Path(started).touch()  # on the trainer thread, in the step
    time.sleep(float(os.environ.get("SLOW_STEP_SECONDS", "0")))
    gate, deadline = os.environ.get("STEP_GATE"), time.monotonic() + GATE_SECONDS
    while gate and Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return _step(self, samples, *args, **kwargs)


Trainer.step = _slow_step

if __name__ == "__main__":
    from echo_coordinator.cli import main

    main()

"""`echo-coordinator` whose every trainer step first sleeps SLOW_STEP_SECONDS: a step long enough
to be interrupted, with every other code path the real coordinator's."""

import os
import time

from echo_coordinator.trainer.learner import Trainer

_step = Trainer.step


def _slow_step(self, samples, *args, **kwargs):
    time.sleep(float(os.environ["SLOW_STEP_SECONDS"]))
    return _step(self, samples, *args, **kwargs)


Trainer.step = _slow_step

if __name__ == "__main__":
    from echo_coordinator.cli import main

    main()

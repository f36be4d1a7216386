"""A trainer rank other than 0: load the model, then train on what rank 0 sends until it says
stop (the rank protocol is `distributed`; this is the loop that serves it)."""

from __future__ import annotations

import logging
from pathlib import Path

from echo_coordinator.trainer import samples
from echo_coordinator.trainer.distributed import (DELTA, GATHER, LOAD, RESUME, SAVE, STEP, STOP, VIEW, WEIGHTS,
                                                  DistributedError, Ranks, die_with_parent)
from echo_coordinator.trainer.learner import Trainer

log = logging.getLogger(__name__)


def run_worker(ranks: Ranks, source: Path, config, temperature: float, seed: int, update: str) -> int:
    """Load the model, then train on what rank 0 sends until it says stop."""
    die_with_parent()
    trainer = Trainer(source, config, temperature, seed, update, ranks=ranks)
    channel = trainer.channel
    while True:
        try:
            command, version, payload = channel.receive()
            if command == STEP:
                trainer.step(samples.decode(payload), version)
            elif command == LOAD:
                trainer.receive_state(version, payload)
            # Sharded: rank 0's collective calls, which this rank takes part in.
            elif command == GATHER:  # rank 0 verifies on a gathered copy; this rank's is dropped at once
                with trainer.holding(None):
                    pass
            elif command == WEIGHTS:
                trainer.weights()
            elif command == SAVE:
                trainer.save_shards(Path(payload.decode()))
            elif command == RESUME:
                trainer.load_shards(Path(payload.decode()), None)
                trainer.steps = version
            elif command == VIEW:
                trainer.hold_view(None)
            elif command == DELTA:
                trainer.topk_delta(float(payload.decode()))
            elif command == STOP:
                return 0
            else:
                log.error("trainer rank %d: unknown command %d", ranks.rank, command)
                return 1
        except DistributedError as e:  # rank 0 went away (its connections closed), or the ranks disagree
            log.error("trainer rank %d stops: %s", ranks.rank, e)
            return 1

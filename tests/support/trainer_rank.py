"""A trainer worker rank for tests: `python -m tests.support.trainer_rank MODEL CONFIG_JSON [UPDATE]`
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set."""

import json
import sys
from pathlib import Path

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.distributed import Ranks
from echo_coordinator.trainer.worker import run_worker

if __name__ == "__main__":
    update = sys.argv[3] if len(sys.argv) > 3 else "lora"
    sys.exit(run_worker(Ranks.from_env(), Path(sys.argv[1]), TrainerConfig(**json.loads(sys.argv[2])), 1.0, 0, update))

"""One rank of `shard_delta.top_k` over gloo, for tests: `python -m tests.support.top_k_rank`
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and on stdin a JSON list of cases, each
{"k": ..., "values": this rank's non-negative values}; prints, per case, this rank's chosen
indices and every rank's count, as JSON."""

import json
import sys

import numpy as np
import torch.distributed as dist

from echo_coordinator.trainer.shard_delta import top_k

if __name__ == "__main__":
    dist.init_process_group("gloo")
    cases = json.loads(sys.stdin.read())  # chosen together, as a sharded trainer's weights are
    keys = [np.array(case["values"], dtype=np.float32).view(np.uint32) for case in cases]
    chosen, counts = top_k(keys, [case["k"] for case in cases], dist.group.WORLD, "cpu")
    print(json.dumps([{"chosen": c.tolist(), "counts": n} for c, n in zip(chosen, counts)]))
    dist.destroy_process_group()

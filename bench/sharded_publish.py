"""Full-mode publishing on a sharded trainer: each update encoded where the shards live against
the weights gathered onto rank 0 and encoded there, side by side in one run.

Two trainer ranks (FSDP2 over gloo, one process each, this machine), the demo model
(SmolLM2-135M-Instruct, the shipped Q4_1 file dequantized to fp32), full mode, topk-int8 at the
run default density. Each round trains one step, then times
  - sharded: `Trainer.topk_delta` (every rank's top k chosen together, rank 0 joins the parts);
  - gathered: `Trainer.weights()` (every weight gathered onto rank 0) plus rank 0 encoding every
    residual with `protocols.delta.encode`, what an unsharded trainer's publisher does;
and checks the sharded payloads against the whole tensors' top k (ties to the lowest index).

    .venv/bin/python bench/sharded_publish.py [--rounds 3] [--density 0.01]

Prints medians and a final JSON line with `sharded_over_gathered` (time; lower is better) and
`bytes_over_gathered` (what reaches rank 0: the encoded delta against the fp32 weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.config import TrainerConfig  # noqa: E402
from echo_coordinator.main import demo_model_path  # noqa: E402
from echo_coordinator.trainer import distributed  # noqa: E402
from echo_coordinator.trainer.distributed import Ranks  # noqa: E402
from echo_coordinator.trainer.learner import Trainer  # noqa: E402
from echo_coordinator.trainer.samples import TrainSample  # noqa: E402
from protocols import delta  # noqa: E402

CONFIG = dict(threads=1, learning_rate=1e-4, micro_batch_tokens=512, sharding="fsdp")


def batch(seed: int) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for group in range(4):
        prompt = tuple(int(t) for t in rng.integers(100, 20000, size=16))
        for j in range(4):
            completion = tuple(int(t) for t in rng.integers(100, 20000, size=24))
            out.append(TrainSample(prompt, completion, (-2.0,) * 24, (1,) * 24, float(j % 2), group))
    return out


def stable_payload(residual: np.ndarray, density: float) -> bytes:
    """The top k of the whole tensor, ties to the lowest index, as one process would choose."""
    k = delta.topk_count(residual.size, density)
    chosen = np.sort(np.lexsort((np.arange(residual.size), -np.abs(residual)))[:k])
    return delta.topk_payload(chosen, residual[chosen])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = demo_model_path()
    if args.worker:
        from echo_coordinator.trainer.worker import run_worker

        sys.exit(run_worker(Ranks.from_env(), model, TrainerConfig(**CONFIG), 1.0, 0, "full"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(distributed.free_port()), GLOO_SOCKET_IFNAME="lo")
    worker = subprocess.Popen([sys.executable, __file__, "--worker"],
                              env=dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1"))
    leader = Trainer(model, TrainerConfig(**CONFIG), 1.0, update="full", ranks=Ranks(0, 2, 0))
    start = leader.weights()
    view = delta.DeltaEncoder(start)  # what nodes hold, advanced by the sharded payloads
    leader.hold_view({name: view.view(name) for name in view.names})
    times = {"sharded": [], "gather": [], "encode": []}
    payload_bytes = 0
    for seed in range(args.rounds):
        leader.step(batch(seed))
        started = time.perf_counter()
        payloads = leader.topk_delta(args.density)
        times["sharded"].append(time.perf_counter() - started)
        started = time.perf_counter()
        target = leader.weights()
        times["gather"].append(time.perf_counter() - started)
        started = time.perf_counter()
        for name in view.names:
            delta.encode(view.residual(name, target[name]), "topk-int8", density=args.density)
        times["encode"].append(time.perf_counter() - started)
        wrong = [n for n in view.names if payloads[n] != stable_payload(view.residual(n, target[n]).ravel(), args.density)]
        if wrong:
            sys.exit(f"round {seed}: the sharded payloads of {wrong[:3]} are not the top k")
        view.advance(payloads, "topk-int8")
        payload_bytes = sum(len(p) for p in payloads.values())
        print(f"round {seed}: sharded {times['sharded'][-1]:.2f} s; gathered {times['gather'][-1]:.2f} s "
              f"+ encoded on rank 0 {times['encode'][-1]:.2f} s", flush=True)
    leader.channel.send(distributed.STOP)
    worker.wait(timeout=60)
    median = {k: statistics.median(v) for k, v in times.items()}
    gathered_bytes = 4 * sum(v.size for v in start.values())
    print(f"\n{'path':<34}{'seconds':>10}{'bytes to rank 0':>18}")
    print(f"{'sharded (topk_delta)':<34}{median['sharded']:>10.2f}{payload_bytes:>18,}")
    print(f"{'gathered + encoded on rank 0':<34}{median['gather'] + median['encode']:>10.2f}{gathered_bytes:>18,}")
    print(json.dumps({"sharded_over_gathered": round(median["sharded"] / (median["gather"] + median["encode"]), 3),
                      "bytes_over_gathered": round(payload_bytes / gathered_bytes, 4), "rounds": args.rounds,
                      "density": args.density, "ranks": 2}))


if __name__ == "__main__":
    main()

"""What llama.cpp's worker process (`engines.llama_process`) costs a node, side by side with
llama.cpp in the node's own process (`engines.llama_backend`), on the demo model (SmolLM2-135M
Q4_1, the shipped file):

- load: from constructing the backend to its first answer (the join's model-load phase);
- tokens/s: one lease's batch (8 prompts x `--tokens` new tokens, parallel 8), the two
  alternating `--rounds` times so that both see the same machine;
- restart: from the worker's death (SIGKILL) to its replacement answering again;
- memory: the worker's resident set, against what loading the model adds to the node's own.

    .venv/bin/python bench/llama_worker.py [--rounds 5] [--tokens 64] [--threads 2]

Ends with a JSON line: `load_ratio` and `rate_ratio` (worker / in-process, medians) and the
medians in seconds and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.main import demo_model_path  # noqa: E402
from engines.backend import BackendCrashed, Request  # noqa: E402
from engines.llama_backend import LlamaBackend  # noqa: E402
from engines.llama_process import LlamaProcess  # noqa: E402


def timed(make):
    started = time.perf_counter()
    value = make()
    return value, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = demo_model_path()
    options = dict(threads=args.threads, n_ctx=512, parallel=8)

    loads = {"in-process": [], "worker": []}
    for _ in range(args.rounds):
        for kind, make in (("in-process", lambda: LlamaBackend(model, **options)),
                           ("worker", lambda: LlamaProcess(model, **options))):
            backend, seconds = timed(make)
            loads[kind].append(seconds)
            if kind == "worker":
                backend.close()
            del backend

    node = psutil.Process()
    before = node.memory_info().rss
    here = LlamaBackend(model, **options)
    here.generate([Request((1, 2, 3), 8, 1)], 1.0)
    in_process_mib = (node.memory_info().rss - before) / 2**20
    worker = LlamaProcess(model, **options)
    worker.generate([Request((1, 2, 3), 8, 1)], 1.0)
    worker_mib = psutil.Process(worker._process.pid).memory_info().rss / 2**20
    prompt = tuple(here.tokenize("<|im_start|>user\nWhat is 17 + 25? Think step by step.<|im_end|>\n"
                                 "<|im_start|>assistant\n"))
    requests = [Request(prompt, args.tokens, seed) for seed in range(8)]
    rates = {"in-process": [], "worker": []}
    for _ in range(args.rounds):
        for kind, backend in (("in-process", here), ("worker", worker)):
            done, seconds = timed(lambda: backend.generate(requests, 1.0))
            rates[kind].append(sum(len(c.token_ids) for c in done) / seconds)
    assert worker.generate(requests, 1.0) == here.generate(requests, 1.0)  # the same samples

    restarts = []
    for _ in range(args.rounds):
        os.kill(worker._process.pid, signal.SIGKILL)
        started = time.perf_counter()
        try:
            worker.generate(requests[:1], 1.0)
            raise AssertionError("a call to a killed worker succeeded")
        except BackendCrashed:
            pass  # the call fails; the next one is answered by a new worker
        worker.generate(requests[:1], 1.0)
        restarts.append(time.perf_counter() - started)
    confined = worker.confined
    worker.close()

    med = {k: statistics.median(v) for k, v in loads.items()}
    rate = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{'':12} {'load s':>8} {'tok/s':>8}")
    for kind in loads:
        print(f"{kind:12} {med[kind]:8.2f} {rate[kind]:8.1f}")
    print(f"{'ratio':12} {med['worker'] / med['in-process']:8.2f} {rate['worker'] / rate['in-process']:8.3f}")
    print(f"restart after a crash (kill to next answer): median {statistics.median(restarts):.2f} s")
    print(f"memory: the worker holds {worker_mib:.0f} MiB; loading in-process adds {in_process_mib:.0f} MiB to the node")
    print(json.dumps({"load_ratio": round(med["worker"] / med["in-process"], 2),
                      "rate_ratio": round(rate["worker"] / rate["in-process"], 3),
                      "load_s": {k: round(v, 2) for k, v in med.items()},
                      "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
                      "restart_s": round(statistics.median(restarts), 2), "rounds": args.rounds,
                      "worker_rss_mib": round(worker_mib), "in_process_rss_mib": round(in_process_mib),
                      "confined": confined}))


if __name__ == "__main__":
    main()

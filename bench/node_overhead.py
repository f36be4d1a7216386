"""What the swarm costs a volunteer: a node's rollout tokens/s through the whole stack against raw
llama-cpp-python generating the same prompts with the same settings, side by side in one run.

Demo model (SmolLM2-135M-Instruct Q4_1), demo task prompts (the seeds an async run leases first;
the demo's 8 prompts a step, so the trainer steps and the node takes each new version),
G = 8 samples of at most 32 tokens at T = 1, `--threads` generation threads, all on CPU 1 (the
coordinator, when it runs, on CPU 0: on one machine of 2 cores it would otherwise take the
node's core to verify):
- raw: `llama_cpp.Llama(...).generate(prompt, temp=1, top_k=0, top_p=1, min_p=0)`, llama.cpp's own
  sampler, default fp16 KV cache;
- backend: the node's `LlamaBackend.generate` (Gumbel-max with lease noise, behaviour logprobs,
  fp32 KV cache), no network;
- stack: a real `echo-node join` against a real coordinator: lease, update, generate, sign,
  push, accept; tokens of accepted leases over the wall time between the first and the last.

    .venv/bin/python bench/node_overhead.py [--leases 12] [--rounds 3] [--threads 1]

Ends with a JSON line: `overhead_ratio` (stack / raw tokens/s, median over rounds; goal >= 0.95),
`backend_ratio` (backend / raw), `network_ratio` (stack / backend) and `update_share` (the share of
the stack's time its node spent taking new versions: a cost of training, not of the network).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if __name__ == "__main__":
    # raw and backend run here, on the node's core. Pinned before anything heavy is imported: an
    # OpenMP pool sized for 2 cores and then pinned to 1 made llama.cpp 2.5x slower (measured).
    os.sched_setaffinity(0, {1})

from echo_coordinator.main import demo_model_path  # noqa: E402

BIN = Path(sys.executable).parent
FIRST_SEED = 500_000  # where an async run with seed 0 starts leasing (RunService first_seed)
GROUP, MAX_NEW = 8, 32
LEASE_LINE = re.compile(r"lease \S+: (\d+) samples \((\d+) tokens\) accepted")
UPDATE_LINE = re.compile(r"updated to version \d+ via .* in ([\d.]+)s")


def prompts(count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from engines.hf import prompt_ids
    from tasks import make_task

    model = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    task = make_task("arithmetic")
    return [list(prompt_ids(tokenizer, task.episode(FIRST_SEED + i).messages)) for i in range(count)]


def raw_rate(batch: list[list[int]], threads: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(str(demo_model_path()), n_threads=threads, n_ctx=2048, verbose=False)
    eos, tokens, started = llm.token_eos(), 0, time.perf_counter()
    for prompt in batch:
        for j in range(GROUP):
            llm.set_seed(j)
            for n, token in enumerate(llm.generate(prompt, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, reset=True), 1):
                if token == eos or n == MAX_NEW:
                    break
            tokens += n
    return tokens / (time.perf_counter() - started)


def backend_rate(batch: list[list[int]], threads: int) -> float:
    from engines.llama_backend import LlamaBackend

    backend = LlamaBackend(demo_model_path(), threads=threads, n_ctx=2048)
    tokens, started = 0, time.perf_counter()
    for i, prompt in enumerate(batch):
        for j in range(GROUP):
            tokens += len(backend.generate(prompt, MAX_NEW, 1.0, 1000 * i + j).token_ids)
    return tokens / (time.perf_counter() - started)


def stack_rate(leases: int, threads: int, work: Path) -> tuple[float, float]:
    """Tokens/s of accepted leases 2..N of one node of a real run (lease 1 pays the start), and
    the share of that time the node spent taking new versions (fetch, verify, adapter swap)."""
    (work / "run.toml").write_text(f"""
[run]
mode = "async"
steps = 1000
prompts_per_step = 8
lead_steps = 100
group_size = {GROUP}
max_new_tokens = {MAX_NEW}
min_nodes = 1
port = 0
data_dir = "{work / 'run'}"
dashboard = false

[trainer]
threads = 1
""")
    log = open(work / "coordinator.log", "w")
    coordinator = subprocess.Popen(["taskset", "-c", "0", str(BIN / "echo-coordinator"), "start", "--demo",
                                    "--config", str(work / "run.toml"), "--verbose"], stdout=log, stderr=subprocess.STDOUT)
    node = None
    try:
        while not (work / "run" / "join.txt").exists():
            if coordinator.poll() is not None:
                raise SystemExit(f"coordinator failed: {(work / 'coordinator.log').read_text()[-2000:]}")
            time.sleep(0.2)
        argv = shlex.split((work / "run" / "join.txt").read_text())
        node = subprocess.Popen(["taskset", "-c", "1", str(BIN / argv[0]), *argv[1:], "--model", str(demo_model_path()),
                                 "--data-dir", str(work / "node"), "--threads", str(threads)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: list[tuple[float, int]] = []
        updating = 0.0
        for text in node.stdout:
            found, update = LEASE_LINE.search(text), UPDATE_LINE.search(text)
            if update and seen:
                updating += float(update[1])
            if found:
                seen.append((time.monotonic(), int(found[2])))
                if len(seen) == leases:
                    break
        if len(seen) < leases:
            raise SystemExit(f"the node stopped after {len(seen)} leases (code {node.wait()})")
        window = seen[-1][0] - seen[0][0]
        return sum(t for _, t in seen[1:]) / window, updating / window
    finally:
        for proc in (node, coordinator):
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leases", type=int, default=12, help="leases (2 prompts, G samples each) per stack round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    batch = prompts(2 * args.leases)  # the demo leases 2 prompts at a time
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="echo-overhead-") as tmp:
            rates = dict(raw=raw_rate(batch, args.threads), backend=backend_rate(batch, args.threads))
            rates["stack"], rates["updating"] = stack_rate(args.leases, args.threads, Path(tmp))
        rows.append(rates)
        print(f"round {r}: raw {rates['raw']:.1f} tok/s, backend {rates['backend']:.1f}, stack {rates['stack']:.1f}"
              f"  (stack/raw {rates['stack'] / rates['raw']:.3f}; {100 * rates['updating']:.1f} % of the stack's time "
              "taking new versions)", flush=True)

    def median_ratio(a: str, b: str) -> float:
        return round(statistics.median(row[a] / row[b] for row in rows), 3)

    print(f"\n{'':<10}{'tok/s (median)':>15}")
    for name in ("raw", "backend", "stack"):
        print(f"{name:<10}{statistics.median(row[name] for row in rows):>15.1f}")
    print(json.dumps(dict(overhead_ratio=median_ratio("stack", "raw"), backend_ratio=median_ratio("backend", "raw"),
                          network_ratio=median_ratio("stack", "backend"),
                          update_share=round(statistics.median(row["updating"] for row in rows), 3),
                          tokens_per_second={k: round(statistics.median(row[k] for row in rows), 1)
                                             for k in ("raw", "backend", "stack")},
                          rounds=args.rounds, leases=args.leases, threads=args.threads)))


if __name__ == "__main__":
    main()

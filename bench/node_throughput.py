"""What a node makes of its machine: rollout tokens/s of batched generation, side by side in one run.

For each model (the demo's SmolLM2-135M-Instruct Q4_1, 49k vocabulary; a tiny random Llama with
Qwen's 152k vocabulary, where the sampler's share is largest) and each batch B (8, 32):
- sequential (before): the node's path before batching, kept here as it was: one sequence at a
  time, `eval()` per token, every logits row kept, numpy noise (protocols.sampling's definition);
- raw single: llama-cpp-python's `Llama.generate`, llama.cpp's own sampler, one sequence at a time;
- raw batched: llama.cpp's batched decode of B sequences a wave (one `llama_decode` a step,
  prompt shared), greedy by numpy argmax, each sequence as many tokens as the backend's
  completion of it had: the same work with nothing but the decode;
- backend: the node's `LlamaBackend.generate` at `parallel` B (batched decode, lease noise,
  behaviour logprobs);
- stack (demo model): a real `echo-node join --parallel B` against a real coordinator: lease,
  generate, sign, push, accept; tokens of accepted leases 3..N over the wall time from the
  2nd acceptance to the last (a new key's first two leases are one prompt each).
G = 8 samples of at most 32 tokens a prompt, T = 1. With `--threads 1` raw/backend run here on
CPU 1, as the stack's node does, and the coordinator runs on CPU 0 (it verifies); with
`--threads 2` everything uses both cores, so the stack's node shares them with the coordinator
(a real volunteer does not).

Also: the sampler's cost per row at 152k (compiled, and the numpy definition), and verification
against a training step on the demo batch (`bench/trainer_step.py`'s batch, at full checking).

    .venv/bin/python bench/node_throughput.py [--rounds 3] [--threads 1] [--leases 4] [--batches 8,32]

Ends with one JSON line: `stack_over_raw_batched` and `stack_over_sequential` at batch 8 (goals
>= 0.9 and >= 1.8), the same at 32, `sampler_ms_152k` (goal <= 0.25) and `verify_over_train`
(goal <= 0.2); medians over rounds.
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
sys.path.insert(0, str(ROOT / "bench"))


def cpus(threads: int, role: str) -> str:
    """The CPUs of the node's side ("node") or the coordinator's: one each, or both shared."""
    return ("1" if role == "node" else "0") if threads == 1 else "0,1"


if __name__ == "__main__":
    # Pinned before anything heavy is imported: an OpenMP pool sized for 2 cores and then pinned
    # to 1 made llama.cpp 2.5x slower (measured).
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--threads", type=int, default=1)
    os.sched_setaffinity(0, {int(c) for c in cpus(early.parse_known_args()[0].threads, "node").split(",")})

import numpy as np  # noqa: E402

from echo_coordinator.main import demo_model_path  # noqa: E402
from llama_raw import GROUP, MAX_NEW, backend_rate, prompts, raw_batched, raw_single, requests_of, wide_model  # noqa: E402

BIN = Path(sys.executable).parent
WIDE_VOCAB = 152064
LEASE_LINE = re.compile(r"lease \S+: (\d+) samples \((\d+) tokens\) accepted")


def sequential_before(model: Path, batch, threads: int) -> float:
    """The node's generation before batching, as it was (LlamaBackend.generate of 2026-12-01)."""
    import llama_cpp

    from protocols import sampling

    llm = llama_cpp.Llama(str(model), logits_all=True, n_ctx=2048, verbose=False, n_threads=threads,
                          n_threads_batch=threads, type_k=0, type_v=0)  # fp32 KV
    eos, made, started = llm.token_eos(), 0, time.perf_counter()
    for r in requests_of(batch):
        cached = 0
        for a, b in zip(llm.input_ids[: llm.n_tokens], r.prompt_ids[:-1]):
            if a != b:
                break
            cached += 1
        if cached == 0:
            llm.reset()
        llm.n_tokens = cached
        llm.eval(list(r.prompt_ids[cached:]))
        tokens = []
        while len(tokens) < MAX_NEW:
            row = llm.scores[llm.n_tokens - 1].astype(np.float64)
            token = sampling.choose(row, sampling.noise(r.seed, [len(tokens)], len(row))[0])
            tokens.append(token)
            float(sampling.log_softmax(row)[token])
            if token == eos or len(tokens) == MAX_NEW:
                break
            llm.eval([token])
        made += len(tokens)
    return made / (time.perf_counter() - started)


def stack_rate(parallel: int, leases: int, threads: int, work: Path) -> float:
    """Tokens/s of accepted leases 3..N of one node of a real async run, over the time from the
    2nd acceptance to the last."""
    (work / "run.toml").write_text(f"""
[run]
mode = "async"
steps = 1000
prompts_per_step = 8  # a step after 8 accepted prompts: after lease 5 (1 + 1 + 2 + 2 + 2); keep --leases <= 4
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
    coordinator = subprocess.Popen(["taskset", "-c", cpus(threads, "coordinator"), str(BIN / "echo-coordinator"), "start", "--demo",
                                    "--config", str(work / "run.toml"), "--verbose"], stdout=log, stderr=subprocess.STDOUT)
    node = None
    try:
        while not (work / "run" / "join.txt").exists():
            if coordinator.poll() is not None:
                raise SystemExit(f"coordinator failed: {(work / 'coordinator.log').read_text()[-2000:]}")
            time.sleep(0.2)
        argv = shlex.split((work / "run" / "join.txt").read_text())
        node = subprocess.Popen(["taskset", "-c", cpus(threads, "node"), str(BIN / argv[0]), *argv[1:], "--model", str(demo_model_path()),
                                 "--data-dir", str(work / "node"), "--threads", str(threads), "--parallel", str(parallel),
                                 "--verbose"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: list[tuple[float, int]] = []
        for text in node.stdout:
            if found := LEASE_LINE.search(text):
                seen.append((time.monotonic(), int(found[2])))
                if len(seen) == leases:
                    break
        if len(seen) < leases:
            raise SystemExit(f"the node stopped after {len(seen)} leases (code {node.wait()})")
        # A new key's first two leases are one prompt each (the first-lease rule, and the one
        # generated while the first is judged): the steady state starts with the third.
        return sum(t for _, t in seen[2:]) / (seen[-1][0] - seen[1][0])
    finally:
        for proc in (node, coordinator):
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        log.close()


def sampler_ms(vocab: int, rows: int = 32, repeats: int = 5) -> dict[str, float]:
    """Per row, ms: the compiled sampler over a batch of rows, and the numpy definition one row at a time."""
    from engines.sampler import sample_rows
    from protocols import sampling

    logits = (np.random.default_rng(0).standard_normal((rows, vocab)) * 4).astype(np.float32)
    seeds, positions = list(range(rows)), [3] * rows
    sample_rows(logits, 1.0, seeds, positions)  # compile
    compiled = []
    for _ in range(repeats):
        started = time.perf_counter()
        sample_rows(logits, 1.0, seeds, positions)
        compiled.append((time.perf_counter() - started) * 1000 / rows)
    started = time.perf_counter()
    for r in range(8):
        row = logits[r].astype(np.float64)
        sampling.choose(row, sampling.noise(r, [3], vocab)[0])
        sampling.log_softmax(row)
    return dict(compiled=statistics.median(compiled), numpy=(time.perf_counter() - started) * 1000 / 8)


def verify_over_train(threads: int, repeats: int = 2) -> float:
    """Verifying the demo batch at full checking over a training step on it (bench/trainer_step.py),
    medians of `repeats` each after a warm-up of each."""
    import torch

    from bench.trainer_step import demo_batch
    from echo_coordinator.config import TrainerConfig
    from echo_coordinator.trainer.learner import Trainer

    torch.set_num_threads(threads)
    trainer = Trainer(demo_model_path(), TrainerConfig(learning_rate=3e-4, threads=threads), temperature=1.0)
    samples = demo_batch(trainer)
    seeds = list(range(len(samples)))

    def seconds(work) -> float:
        work()  # warm-up: compile, allocator
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return seconds(lambda: trainer.evidence(samples, seeds)) / seconds(lambda: trainer.step(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--leases", type=int, default=4,
                        help="accepted leases per stack measurement (at most 4: a training step follows the 5th)")
    parser.add_argument("--batches", default="8,32")
    args = parser.parse_args()
    from engines.sampler import use_threads

    use_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    texts = prompts(4)
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="echo-throughput-") as tmp:
        models = {"demo": demo_model_path(), "152k": wide_model(Path(tmp), WIDE_VOCAB)}
        for r in range(args.rounds):
            row: dict[str, float] = {}
            for name, model in models.items():
                row[f"{name} sequential"] = sequential_before(model, texts[:2], args.threads)
                row[f"{name} raw single"] = raw_single(model, texts[:2], args.threads)
                for b in batches:
                    batch = texts[: max(2, b // GROUP)]
                    backend = backend_rate(model, batch, b, args.threads)
                    row[f"{name} backend@{b}"] = backend.tokens_per_s
                    row[f"{name} raw batched@{b}"] = raw_batched(model, batch, b, args.threads, backend.lengths).tokens_per_s
            for b in batches:
                with tempfile.TemporaryDirectory(prefix="echo-stack-") as work:
                    row[f"demo stack@{b}"] = stack_rate(b, args.leases, args.threads, Path(work))
            rows.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    sampler = sampler_ms(WIDE_VOCAB)
    verify = verify_over_train(args.threads)

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(row[a] / row[b] for row in rows), 3)

    print(f"\n{'tok/s, median of ' + str(args.rounds):<28}" + "".join(f"{m:>10}" for m in models))
    for label in ["sequential", "raw single"] + [f"{k}@{b}" for b in batches for k in ("raw batched", "backend")]:
        print(f"{label:<28}" + "".join(f"{median(f'{m} {label}'):>10.1f}" for m in models))
    for b in batches:
        print(f"{'stack@' + str(b):<28}{median(f'demo stack@{b}'):>10.1f}{'-':>10}")
    print(f"sampler per row at 152k: {sampler['compiled']:.3f} ms compiled, {sampler['numpy']:.3f} ms numpy definition")
    print(f"verification / training step (demo batch, full checking): {verify:.3f}")
    out = dict(stack_over_raw_batched=ratio("demo stack@8", "demo raw batched@8"),
               stack_over_sequential=ratio("demo stack@8", "demo sequential"),
               sampler_ms_152k=round(sampler["compiled"], 3), verify_over_train=round(verify, 3))
    for b in batches[1:]:
        out[f"stack_over_raw_batched@{b}"] = ratio(f"demo stack@{b}", f"demo raw batched@{b}")
        out[f"stack_over_sequential@{b}"] = ratio(f"demo stack@{b}", "demo sequential")
    out["backend_over_sequential_152k@8"] = ratio("152k backend@8", "152k sequential")
    out["tokens_per_second"] = {k: round(median(k), 1) for k in rows[0]}
    out.update(rounds=args.rounds, threads=args.threads, sampler_ms_152k_numpy=round(sampler["numpy"], 3))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The verifier's fused pass (`engines.triton_scan`, through `engines.device_sampler.Scoring`) gives
the definition's margins: the same argmax and margins within 1e-12 of `protocols.sampling`, ties
included. Here under Triton's interpreter on the CPU (the kernel's own code, run by numpy); on a
GPU, compiled for CUDA (`gpu`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from protocols.sampling import gumbel, log_softmax, margins

ROOT = Path(__file__).resolve().parents[3]


def rows_and_tokens(rng: np.random.Generator, n: int, vocab: int):
    """float32 logits / T with a flat row, a certain row, near ties of the best z, bf16-like exact
    logit ties in greedy rows; seeds (some None: greedy); positions; node tokens (a third agree)."""
    rows = (rng.standard_normal((n, vocab)) * 2.5).astype(np.float32)
    rows[0] = 0.0
    rows[1, 5] += 40.0
    rows[2] = (rows[2] * 1e-3).astype(np.float32)
    seeds = [int(s) for s in rng.integers(0, 2**63, n)]
    for r in (4, 9):
        seeds[r] = None
        rows[r] = np.round(rows[r] * 4) / 4  # many exactly equal logits
        rows[r, :3] = rows[r].max()  # the largest one three times
    positions = rng.integers(0, 4096, n)
    z = [rows[r].astype(np.float64) + (0 if seeds[r] is None else gumbel(seeds[r], [positions[r]], vocab)[0])
         for r in range(n)]
    for r in range(10, n, 3):  # a near tie: another entry's z within a float32 rounding of the best's
        if seeds[r] is None:
            continue
        a = int(np.argmax(z[r]))
        j = (a + 17) % vocab
        rows[r, j] = np.float32(z[r][a] - (z[r][j] - rows[r, j]))  # z_j = l_j + g_j ~ z_a
    argmax = np.array([int(np.argmax(rows[r].astype(np.float64) + (0 if seeds[r] is None else
                       gumbel(seeds[r], [positions[r]], vocab)[0]))) for r in range(n)])
    tokens = rng.integers(0, vocab, n)
    tokens[::3] = argmax[::3]
    return rows, seeds, positions, tokens, argmax


def check_against_the_definition(device: str, tie: float | None) -> dict:
    """Run the fused scorer on `device`, chunk by chunk; compare with the definition."""
    from engines import device_sampler

    if tie is not None:
        device_sampler.TIE = tie
    rng = np.random.default_rng(21)
    vocab, n = 3000, 36
    rows, seeds, positions, tokens, argmax = rows_and_tokens(rng, n, vocab)
    on = torch.from_numpy(rows).to(device)
    scoring = device_sampler.Scoring(on.device, seeds, positions, tokens)
    assert scoring.fused
    for a in range(0, n, 16):
        scoring.add(on[a : a + 16])
    got, logprobs = scoring.result(lambda r: on[torch.from_numpy(r).to(on.device)])
    best = scoring.out["best"].cpu().numpy()
    worst = 0.0
    for r in range(n):
        noise = np.zeros((1, vocab)) if seeds[r] is None else gumbel(seeds[r], [positions[r]], vocab)
        want = margins(rows[r : r + 1], noise, tokens[r : r + 1])[0]
        worst = max(worst, abs(got[r] - want))
        assert abs(logprobs[r] - log_softmax(rows[r])[tokens[r]]) < 1e-5
    exact_best = [bool(best[r] == argmax[r]) or seeds[r] is None for r in range(n)]
    return dict(worst=worst, best_agrees=all(exact_best), agree_zero=bool((got[::3] == 0).all()),
                differ=int((got > 0).sum()))


def run_interpreted(tie: float | None) -> dict:
    code = ("import json, sys; sys.path.insert(0, %r); from tests.unit.engines.test_fused_scan import "
            "check_against_the_definition as c; print(json.dumps(c('cpu', %r)))" % (str(ROOT), tie))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tie", [None, 10.0], ids=["device-argmax", "every-row-rescanned"])
def test_the_fused_kernel_gives_the_definitions_margins(tie):
    if sys.platform != "linux":  # the dev extras bring Triton on Linux, where CI runs
        pytest.importorskip("triton")
    found = run_interpreted(tie)
    assert found["worst"] <= 1e-12, found
    assert found["best_agrees"] and found["agree_zero"] and found["differ"] >= 15, found


@pytest.mark.gpu
def test_the_fused_kernel_on_cuda_gives_the_definitions_margins():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    found = check_against_the_definition("cuda", None)
    assert found["worst"] <= 1e-12 and found["best_agrees"] and found["agree_zero"], found


def evidence_both_ways() -> dict:
    """`Trainer.evidence` of a tiny model's batch through the fused path (the kernel interpreted
    on the CPU, as on a GPU: chunks, one transfer, the exact noise of two entries a row) and
    through the compiled scan: the same margins, bit for bit."""
    import tempfile

    from echo_coordinator.config import TrainerConfig
    from echo_coordinator.trainer.learner import Trainer
    from tests.support.tiny_model import build_tiny_gguf
    from tests.unit.echo_coordinator.trainer.test_grpo import samples_for

    trainer = Trainer(build_tiny_gguf(Path(tempfile.mkdtemp()) / "tiny.gguf", init_std=0.3),
                      TrainerConfig(lora_rank=4, lora_init="random", threads=1), temperature=0.7)
    from engines import device_sampler

    samples = samples_for(trainer)
    seeds = [3, 4, None, 5]
    took_kernel = device_sampler.fused(trainer.device)
    fused = trainer.evidence(samples, seeds)
    os.environ["TRITON_INTERPRET"] = "0"  # `device_sampler.fused` reads it at each call
    compiled = trainer.evidence(samples, seeds)
    return dict(took_kernel=took_kernel, same=[f.max_margin == c.max_margin and f.flips == c.flips for f, c in zip(fused, compiled)],
                logprob_gap=max(abs(f.mean_logprob_error - c.mean_logprob_error) for f, c in zip(fused, compiled)),
                flips=sum(c.flips for c in compiled))


def test_evidence_through_the_fused_path_is_the_compiled_scans():
    if sys.platform != "linux":
        pytest.importorskip("triton")
    code = ("import json, sys; sys.path.insert(0, %r); from tests.unit.engines.test_fused_scan import "
            "evidence_both_ways as e; print(json.dumps(e()))" % str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["took_kernel"] and all(found["same"]) and found["logprob_gap"] < 1e-5 and found["flips"] > 0, found

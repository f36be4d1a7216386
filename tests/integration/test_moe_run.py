"""A mixture of experts end to end: a tiny random Qwen3-MoE checkpoint through a real coordinator
with two q4_k_m nodes, one of them keeping its experts in system RAM (`--cpu-moe`), two versions
in LoRA mode and in full mode (where each node requantizes every version), the two runs at once.
Every batch is verified against the nodes' own weights, routing flips included
(`trainer/evidence.py`), and no honest key is struck; the trained policy exports as an HF
checkpoint and a GGUF."""

import shlex
import subprocess
import sys

import numpy as np
import torch

from engines.hf import load_model
from engines.llama_backend import LlamaBackend
from tests.integration.test_architectures import F32_TOLERANCE, hf_logprobs, llama_logprobs
from tests.support.runs import VENV_BIN, journal, metrics, spawn, wait_for
from tests.support.tiny_model import build_tiny_checkpoint

STEPS = 2
UPDATES = ("lora", "full")


def start(processes, tmp_path, checkpoint, update: str):
    """A coordinator of a run in `update` mode; its run directory. In full mode each node
    re-exports every version requantized to q4_k_m, which the verifier must check against: a
    step of 0.01 a weight (Adam's first step is the learning rate on every weight with a
    gradient) leaves the float weights far enough from their requantization that checking
    against the float ones refused honest batches (before 2026-12-03); at 0.001 most changes
    round back to the base's grid and it did not always show."""
    run_dir = tmp_path / update / "run"
    config = tmp_path / update / "run.toml"
    config.parent.mkdir()
    config.write_text(f"""
[run]
model = "{checkpoint}"
node_quant = "q4_k_m"
update = "{update}"
task = "tests.support.envs:LetterE"  # rewards a random model can vary on, so steps train
steps = {STEPS}
prompts_per_step = 4
group_size = 4
max_new_tokens = 16
min_nodes = 2
verify_fraction = 1.0
port = 0
data_dir = "{run_dir}"
dashboard = false

[trainer]
lora_rank = 4
learning_rate = 0.01  # full mode: every weight moves 0.01 a step, past q4_k_m's rounding (see `start`)
threads = 1
""")
    spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)],
          tmp_path / update / "coordinator.log")
    return run_dir


def test_moe_checkpoint_trains_on_quantized_nodes_in_both_modes_and_exports(tmp_path, processes):
    # The calibrated tiny MoE (docs/verification.md). Its rows are too narrow for k-quants: q4_k_m
    # stores most tensors as q5_0 and q8_0, as llama.cpp's quantizer does for such rows.
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny-moe", "qwen3_moe", init_std=0.2)
    runs = {update: start(processes, tmp_path, checkpoint, update) for update in UPDATES}
    coordinators = list(processes)
    nodes = {}
    for update, run_dir in runs.items():
        wait_for((run_dir / "join.txt").exists, 180, "the join line", coordinators)
        argv = shlex.split((run_dir / "join.txt").read_text())
        for name, extra in (("gpu-less", []), ("experts-in-ram", ["--cpu-moe"])):
            log = tmp_path / update / f"{name}.log"
            args = [str(VENV_BIN / argv[0]), *argv[1:], "--name", name, "--data-dir", str(tmp_path / update / name),
                    "--threads", "1", *extra]
            nodes[log] = spawn(processes, args, log)
    for update, coordinator in zip(UPDATES, coordinators):
        assert coordinator.wait(timeout=300) == 0, (tmp_path / update / "coordinator.log").read_text()[-3000:]
    for log, proc in nodes.items():
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert f"finished at version {STEPS}" in log.read_text(), log.read_text()[-3000:]
        if log.stem == "experts-in-ram":
            assert "experts in RAM (every layer)" in log.read_text()

    base = hf_logprobs(load_model(checkpoint, dtype=torch.float32))
    for update, run_dir in runs.items():
        steps = metrics(run_dir)
        assert [s["version"] for s in steps] == list(range(STEPS))
        assert all(s["trained_samples"] > 0 for s in steps)
        # Both nodes' batches were checked (verify_fraction = 1), and no key was struck. An honest
        # MoE node's batch is refused as a lone `outlier` about once in 125 16-sample batches
        # (routing flips the re-check cannot replay, docs/verification.md); that is no strike.
        assert sum(s["verified_samples"] for s in steps) >= STEPS * 4 * 4, (update, steps)
        assert journal(run_dir, "SELECT SUM(failed) FROM trust") == [(0,)]
        refused = journal(run_dir, "SELECT reason, SUM(count) FROM rejections GROUP BY reason")
        # (`rejections` counts samples: one refused lease is up to prompts_per_step x group_size of them.)
        assert set(reason for reason, _ in refused) <= {"outlier"} and sum(n for _, n in refused) <= 4 * 4, refused

        out = tmp_path / update / "exported"
        done = subprocess.run([sys.executable, "-m", "echo_coordinator.cli", "export", "--data-dir", str(run_dir),
                               "--out", str(out), "--gguf", "f32"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        exported = hf_logprobs(load_model(out, dtype=torch.float32))
        assert np.abs(exported - base).max() > 1e-4, update  # training changed the policy
        [gguf] = out.glob("*.gguf")
        assert np.abs(llama_logprobs(LlamaBackend(gguf, threads=1, n_ctx=128)) - exported).max() < F32_TOLERANCE

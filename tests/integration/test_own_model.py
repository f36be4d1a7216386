"""Bring your own model, end to end: a tiny random Qwen2 HF checkpoint through a real coordinator,
which makes the nodes' q8_0 GGUF; one node joins without --model and fetches it, a second joins
later and fetches it from the first; the trained policy is exported and loads in transformers
and llama.cpp."""

import json
import re
import shlex
import subprocess
import sys

import gguf
import numpy as np
import torch

from echo_coordinator.config import TrainerConfig
from echo_coordinator.trainer.learner import Trainer
from engines.gguf_io import FILE_TYPES
from engines.hf import load_model
from engines.llama_backend import LlamaBackend
from protocols.signing import sha256_file
from tests.integration.test_architectures import Q8_KL, hf_logprobs, kl, llama_logprobs
from tests.support.runs import VENV_BIN, spawn, wait_for
from tests.support.tiny_model import build_tiny_checkpoint

STEPS = 3


def file_type(path) -> int:
    return int(gguf.GGUFReader(str(path)).fields["general.file_type"].contents())


def test_qwen2_checkpoint_q8_nodes_fetch_the_base_and_the_result_exports(tmp_path, processes):
    # hidden 128: a 6.7 MB q8_0 file, two 4 MiB chunks, so a fetch is split between providers.
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny-qwen2", "qwen2", hidden_size=128)
    run_dir = tmp_path / "run"
    (tmp_path / "run.toml").write_text(f"""
[run]
model = "{checkpoint}"
node_quant = "q8_0"
task = "tests.support.envs:LetterE"  # rewards a random model can vary on, so steps train
steps = {STEPS}
prompts_per_step = 4
group_size = 4
max_new_tokens = 8
min_nodes = 2
port = 0
data_dir = "{run_dir}"
trainer_upload_copies = 1
dashboard = false

[trainer]
lora_rank = 4
learning_rate = 0.01
threads = 1
""")
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config",
                                    str(tmp_path / "run.toml")], tmp_path / "coordinator.log")
    wait_for((run_dir / "join.txt").exists, 180, "the join line", [coordinator])
    argv = shlex.split((run_dir / "join.txt").read_text())
    assert "--model" not in argv

    # The coordinator made a q8_0 GGUF of the checkpoint, and the run's base is that file.
    [made] = (run_dir / "models").glob("*-q8_0.gguf")
    assert file_type(made) == FILE_TYPES["q8_0"]
    base_sha = sha256_file(made)

    def node(name):
        args = [str(VENV_BIN / argv[0]), *argv[1:], "--name", name, "--data-dir", str(tmp_path / name), "--threads", "1"]
        return spawn(processes, args, tmp_path / f"{name}.log")

    first = node("first")
    wait_for(lambda: "joined run" in (tmp_path / "first.log").read_text(), 120, "the first node to join",
             [coordinator, first])
    second = node("second")  # the coordinator sends one copy (trainer_upload_copies = 1): the rest is relayed
    for proc in (coordinator, first, second):
        assert proc.wait(timeout=300) == 0
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("first", "second")}
    for name, log in logs.items():
        assert (tmp_path / name / "models" / f"{base_sha}.gguf").is_file(), log
        assert f"finished at version {STEPS}" in log, log
    fetched = {name: re.search(r"fetched the base model .*: ([\d.]+) MB from (\d+) peers, ([\d.]+) MB from the "
                               r"coordinator", log) for name, log in logs.items()}
    assert fetched["first"] and float(fetched["first"][3]) > 6  # the first had nobody else to ask
    assert fetched["second"] and float(fetched["second"][1]) > 6 and float(fetched["second"][3]) == 0.0, logs["second"]

    # The trainer ran the full-precision checkpoint, the nodes q8_0: the mismatch is measured, small.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m.get("trained_samples")]
    assert steps and all(0 < m["mismatch_kl"] < Q8_KL for m in steps)
    # Verified against the nodes' own q8_0 weights: honest batches pass.
    assert sum(m["verified_samples"] for m in steps) > 0 and all(m["rejected"] == 0 for m in steps)

    # Export: an HF checkpoint with the adapter merged, and a GGUF of it.
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "echo_coordinator.cli", "export", "--data-dir", str(run_dir),
                           "--out", str(out), "--gguf", "q8_0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    exported = load_model(out, dtype=torch.float32)
    trainer = Trainer(checkpoint, TrainerConfig(lora_rank=4), temperature=1.0)
    from safetensors.numpy import load_file

    trainer.load_weights(load_file(str(run_dir / "adapters" / f"v{STEPS}.safetensors")))
    expected = hf_logprobs(trainer.model)
    assert np.abs(hf_logprobs(exported) - expected).max() < 1e-4  # the merged adapter is the trained policy
    with trainer.model.disable_adapter():
        assert np.abs(hf_logprobs(trainer.model) - expected).max() > 1e-4  # and training changed it
    [exported_gguf] = out.glob("*.gguf")
    assert file_type(exported_gguf) == FILE_TYPES["q8_0"]
    assert kl(expected, llama_logprobs(LlamaBackend(exported_gguf, threads=1, n_ctx=128))) < Q8_KL

"""Full-parameter mode end to end: lossy deltas to a llama.cpp node (re-export + requantize) and a
transformers node, and a late joiner that catches up through a snapshot."""

from __future__ import annotations

import json
import sys

import gguf
import numpy as np
from safetensors.numpy import load_file

from engines.gguf_io import permute_qk
from tests.support.runs import start_node
from tests.support.runs import VENV_BIN, spawn, wait_for

# The late node joins after version 2 and catches up through a snapshot. Its start takes 16-22 s on
# a loaded machine and a version about 1 s, so the run used to end before it joined now and then
# (at 10, 14 and 18 steps): the trainer's steps now wait while it joins (`tests.support.slow_trainer`).
STEPS = 10
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def test_full_mode_nodes_hold_the_broadcast_view(tmp_path, tiny_model, processes):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
model = "{tiny_model}"
task = "tests.support.envs:LetterE"
update = "full"
update_density = 0.05
# Every node fetches from the trainer: peer relay is tested elsewhere, and here a third node told
# "busy" waited 30 s for peers to announce an update, holding a step (2 of them took 31 s).
trainer_upload_copies = 0
snapshot_every = 2
steps = {STEPS}
prompts_per_step = 2
group_size = 4
max_new_tokens = 8
min_nodes = 2
port = 0
data_dir = "{run_dir}"

[trainer]
learning_rate = 0.001
threads = 1
""")
    gate = tmp_path / "hold"  # while it exists, the trainer's steps wait
    coordinator = spawn(processes, [sys.executable, "-m", "tests.support.slow_trainer", "start", "--config",
                                    str(config)], tmp_path / "coordinator.log", STEP_GATE=str(gate))
    wait_for((run_dir / "join.txt").exists, 120, "the join line", [coordinator])
    join = (run_dir / "join.txt").read_text().strip()
    llama = start_node(processes, join, tmp_path, "llama")
    hf = spawn(processes, [str(VENV_BIN / "echo-node"), *join.split()[1:], "--name", "hf", "--data-dir",
                           str(tmp_path / "hf"), "--threads", "1", "--backend", "transformers"], tmp_path / "hf.log")
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 240, "two versions", [coordinator])
    gate.touch()
    late = start_node(processes, join, tmp_path, "late")
    # Steps wait until it asks for work: it prints "joined run" before its master weights are built,
    # and on a busy machine the run once ended before its first lease request (14 s later), leaving
    # it dialling a coordinator that was gone. (A sequential node updates when work needs it.)
    wait_for(lambda: "waiting for work" in (tmp_path / "late.log").read_text(), 120, "the late node to ask for work",
             [late])
    gate.unlink()
    assert coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    for node, name in ((llama, "llama"), (hf, "hf"), (late, "late")):
        assert node.wait(timeout=60) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        assert f"finished at version {STEPS}" in (tmp_path / f"{name}.log").read_text()

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["version"] for r in records] == list(range(STEPS))
    late_log = (tmp_path / "late.log").read_text()
    assert "via snapshot 0->" in late_log  # it did not replay every delta from version 0

    # The llama.cpp node's re-exported weights are the publisher's view, bit for bit.
    checkpoint = run_dir / json.loads((run_dir / "state.json").read_text())["checkpoint"]
    view = load_file(str(checkpoint / "view.safetensors"))
    exported = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "llama" / "weights" / f"v{STEPS}.gguf").tensors}
    assert exported, "no re-exported model"
    checked = 0
    for name, value in view.items():
        parts = name.split(".")
        if parts[-2] not in GGUF_NAMES:
            continue
        expected = permute_qk(value, {"q_proj": 4, "k_proj": 2}[parts[-2]]) if parts[-2] in ("q_proj", "k_proj") else value
        got = exported[f"blk.{parts[2]}.{GGUF_NAMES[parts[-2]]}.weight"].reshape(expected.shape)
        assert got.tobytes() == expected.tobytes(), name
        checked += 1
    assert checked == 14
    trained = load_file(str(checkpoint / "weights.safetensors"))
    assert max(float(np.abs(trained[k] - view[k]).max()) for k in view) < 0.05  # the lossy view tracks training

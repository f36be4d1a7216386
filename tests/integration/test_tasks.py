"""A user-defined multi-turn environment, named by dotted path in run.toml, runs in a real
coordinator + node swarm: the node steps the environment and writes its turns into the
transcript, the trainer replays every episode, scores it and trains on the model's tokens only."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from tests.support.runs import VENV_BIN, join_argv, spawn

REPO = Path(__file__).parents[2]
STEPS = 2


def test_dotted_path_multi_turn_environment_trains(tmp_path, tiny_model, processes):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
model = "{tiny_model}"
task = "tests.support.envs:MoreE"
task_params = {{ max_turns = 3 }}
steps = {STEPS}
prompts_per_step = 2
group_size = 4
max_new_tokens = 8
min_nodes = 1
port = 0
data_dir = "{run_dir}"

[trainer]
lora_rank = 4
learning_rate = 0.01
threads = 1
""")
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)],
                        tmp_path / "coordinator.log")
    argv = join_argv(run_dir, coordinator)
    # The volunteer has the environment's package importable (here: the repo on PYTHONPATH) and
    # allows it: a coordinator alone cannot make a node import code.
    node = spawn(processes, [str(VENV_BIN / argv[0]), *argv[1:], "--name", "n1", "--data-dir", str(tmp_path / "n1"),
                             "--threads", "1", "--allow-task", "tests.support.envs:MoreE"], tmp_path / "n1.log",
                 PYTHONPATH=str(REPO))
    assert coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    assert node.wait(timeout=60) == 0, (tmp_path / "n1.log").read_text()[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == list(range(STEPS))
    for r in records:
        assert r["samples"] == 8 and r["rejected"] == 0 and 0 < r["reward_mean"] < 1
        # Random text never ends an episode early: every one ran its 3 turns.
        assert r["turns_mean"] == 3.0
        # Trained tokens are the model's 3 turns of at most 8 tokens; environment turns are masked out.
        assert 0 < r["tokens"] <= r["trained_samples"] * 3 * 8
    # transcripts.jsonl shows the best and the worst episode of each step as text.
    logged = [json.loads(line) for line in (run_dir / "transcripts.jsonl").read_text().splitlines()]
    assert [x["version"] for x in logged] == list(range(STEPS))
    for x in logged:
        best, worst = x["samples"]
        assert best["reward"] >= worst["reward"] and "Round 1 of game" in best["prompt"]
        assert [role for role, _ in best["turns"]] == ["model", "env", "model", "env", "model"]
        assert "more e!<|im_end|>" in best["turns"][1][1]
    with sqlite3.connect(run_dir / "ledger.sqlite") as db:
        accepted, credited_tokens = db.execute("SELECT SUM(accepted), SUM(tokens) FROM peers").fetchone()
    assert accepted == 8 * STEPS
    # Credit counts the tokens the node generated (every sample's model turns), not environment turns.
    assert sum(r["tokens"] for r in records) <= credited_tokens <= 8 * STEPS * 3 * 8

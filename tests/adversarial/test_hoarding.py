"""Keys that take leases and never answer, over the real transport, against a real coordinator and
an honest node that joins after them: a new key for every request (so no lapse ever shuts one
out), asking from before the run starts. The honest node shadows their leases (issue 36 point 2)
and answers at once; the run finishes, the honest node is never refused, the hoarders are
credited nothing. Before shadow leases this run's steps took 31.0, 10.9 and 10.8 s (each waited
out the hoarders' leases); with them, 4.6, 0.8 and 0.8 s."""

from __future__ import annotations

import asyncio
import json
import sys

from tests.support.hoarders import Hoarders
from tests.support.runs import VENV_BIN, join_argv, spawn
from tests.support.tiny_model import build_tiny_gguf

LEASE_SECONDS = 40  # a new key's lease: 10 s
STEPS = 3


def test_hoarding_keys_cannot_hold_the_run(tmp_path, processes):  # noqa: F811
    model = build_tiny_gguf(tmp_path / "run.gguf", init_std=0.5)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
model = "{model}"
task = "arithmetic"
steps = {STEPS}
prompts_per_step = 8
group_size = 4
max_new_tokens = 8
min_nodes = 1
port = 0
data_dir = "{run_dir}"
lease_seconds = {LEASE_SECONDS}

[trainer]
lora_rank = 4
micro_batch_tokens = 512
threads = 1
""")
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)],
                        tmp_path / "coordinator.log")
    argv = join_argv(run_dir, coordinator)
    address = argv[2]
    hoarders = Hoarders(address, fresh=True)
    # The hoarders ask from before the run starts (it starts when the honest node has joined), so
    # they are first to the step's seeds.
    node = [str(VENV_BIN / argv[0]), *argv[1:], "--threads", "1"]
    spawn(processes, [*node, "--name", "honest", "--data-dir", str(tmp_path / "honest")], tmp_path / "honest.log")
    asyncio.run(asyncio.wait_for(hoarders.run(lambda: coordinator.poll() is not None), timeout=600))
    assert coordinator.wait(timeout=60) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"replies": hoarders.replies, "step_seconds": [round(m["step_seconds"], 1) for m in metrics]}))
    assert len(metrics) == STEPS
    # They held seeds, each time for a new key's short lease.
    assert hoarders.replies["lease"] > 0 and all(lease.expires_at - at <= LEASE_SECONDS / 4 + 1 for at, lease in hoarders.held)
    from echo_coordinator.ledger import Ledger

    ledger = Ledger(run_dir / "ledger.sqlite")
    rows = {p["name"]: p for p in ledger.peers()}
    ledger.close()
    assert rows["honest"]["rejected"] == 0 and rows["honest"]["accepted"] > 0
    assert "hoarder" not in rows or rows["hoarder"]["accepted"] == 0

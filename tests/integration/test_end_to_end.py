"""Coordinator + 2 nodes as real processes: real hivemind on 127.0.0.1, real llama.cpp, real
torch; a tiny random Llama built here so the run fits CI time."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from engines.gguf_io import lora_pairs, permute_qk
from protocols import rpc
from protocols.messages import HoldersRequest
from protocols.multiaddr import peer_of
from protocols.transport.dht import SwarmDHT
from tests.support.runs import STEPS, VENV_BIN, join_argv, spawn, wait_for, write_config
from tests.support.tiny_model import build_tiny_gguf

EVAL = "eval_every = 2\neval_prompts = 6\neval_sampling = \"both\"\neval_samples = 2"


def test_sequential_run_with_two_nodes(tmp_path, tiny_model, processes):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", tiny_model, run_dir, extra=EVAL)
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)],
                        tmp_path / "coordinator.log")
    join_file = run_dir / "join.txt"
    wait_for(join_file.exists, 120, "the join line", [coordinator])
    join_line = join_file.read_text().strip()
    assert join_line in (tmp_path / "coordinator.log").read_text()  # printed verbatim for volunteers
    argv = shlex.split(join_line)
    nodes = []
    for name, sandbox in (("n1", "--sandbox"), ("n2", "--no-sandbox")):
        args = [str(VENV_BIN / argv[0]), *argv[1:], "--name", name, "--data-dir", str(tmp_path / name), "--threads", "1",
                sandbox]
        nodes.append(spawn(processes, args, tmp_path / f"{name}.log"))

    assert coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    for node, name in zip(nodes, ("n1", "n2")):
        assert node.wait(timeout=60) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    # llama.cpp ran in a worker process on both, confined on the first (this kernel has Landlock: test_sandbox).
    assert "llama.cpp runs in a worker process: landlock ABI" in (tmp_path / "n1.log").read_text()
    assert "llama.cpp runs in a worker process: not confined (--no-sandbox)" in (tmp_path / "n2.log").read_text()

    # One metrics line per version, in the documented shape; rewards recomputed by the trainer.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "eval_version" not in r]
    assert [r["version"] for r in records] == list(range(STEPS))
    for r in records:
        assert {"version", "mode", "samples", "reward_mean", "accepted", "rejected", "staleness_max", "step_seconds",
                "wait_seconds", "time"} <= set(r)
        assert r["mode"] == "sequential" and r["samples"] == 16 and r["accepted"] == 16 and r["staleness_max"] == 0
        assert 0 < r["reward_mean"] < 1 and r["trained_samples"] > 0
        # One busy share: the step's time not spent waiting for rollouts, as the dashboard shows it
        # (it used to be the training compute's share here, and 1 - wait/step on the page).
        assert r["busy_fraction"] == pytest.approx(1 - r["wait_seconds"] / r["step_seconds"])
        assert r["busy_seconds"] <= r["step_seconds"] - r["wait_seconds"]
    # Each node's first batch (4 samples) is verified at its push; every later one by the step that
    # trains it, from the step's own forward (LoRA, staleness 0, a key with a verified batch).
    assert sum(r["verified_free"] for r in records) >= 16 * STEPS - 2 * 4

    # Held-out evaluation of versions 0, 2 and the last (3), greedy and sampled, answered by the
    # nodes at exactly those versions; the trainer's own re-run agrees on greedy answers (the tiny
    # model is unquantized, so nodes and trainer pick the same tokens).
    evals = {(r["eval_version"], r["eval_sampling"]): r for r in lines if "eval_version" in r}
    assert sorted(evals) == [(v, s) for v in (0, 2, STEPS) for s in ("greedy", "sampled")]
    for (version, sampling), r in evals.items():
        assert r["eval_complete"] and r["eval_prompts"] == 6 and r["eval_samples"] == (6 if sampling == "greedy" else 12)
        assert 0 <= r["eval_accuracy"] <= 1
    local = subprocess.run([sys.executable, "-m", "echo_coordinator.cli", "eval", "--data-dir", str(run_dir), "--json"],
                           capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
    rerun = {r["eval_sampling"]: r for r in map(json.loads, local.stdout.splitlines())}
    assert rerun["greedy"]["eval_version"] == STEPS
    assert rerun["greedy"]["eval_accuracy"] == pytest.approx(evals[(STEPS, "greedy")]["eval_accuracy"], abs=1 / 6 + 1e-9)
    assert rerun["greedy"]["swarm_accuracy"] == evals[(STEPS, "greedy")]["eval_accuracy"]

    # Every node ends on the last version, holding exactly the adapter the publisher's deltas built
    # (bf16, error feedback), which is close to the trainer's.
    trainer = {STEPS: load_file(str(run_dir / "adapters" / f"v{STEPS}.safetensors")),
               1: load_file(str(run_dir / "adapters" / "v1.safetensors"))}
    assert any(not np.array_equal(trainer[1][k], trainer[STEPS][k]) for k in trainer[1])  # training moved it
    held = load_file(str(run_dir / "adapters" / f"v{STEPS}.held.safetensors"))
    moved = max(float(np.abs(trainer[STEPS][k] - trainer[1][k]).max()) for k in held)
    assert max(float(np.abs(trainer[STEPS][k] - held[k]).max()) for k in held) < moved
    for name in ("n1", "n2"):
        log = (tmp_path / f"{name}.log").read_text()
        assert f"finished at version {STEPS}" in log and f"left the run at version {STEPS}" in log
        node_adapter = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / name / "adapters" / f"v{STEPS}.gguf").tensors}
        pairs = lora_pairs(held)
        assert len(node_adapter) == 2 * len(pairs)
        for hf_name, (a, b) in pairs.items():
            layer = hf_name.split(".")[2]
            proj = hf_name.split(".")[-2]
            gguf_proj = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[proj]
            base = f"blk.{layer}.{gguf_proj}.weight"
            heads = {"q_proj": 4, "k_proj": 2}.get(proj)
            expected_b = permute_qk(b, heads) if heads else b
            assert np.array_equal(node_adapter[base + ".lora_a"].reshape(a.shape), a)
            assert np.array_equal(node_adapter[base + ".lora_b"].reshape(b.shape), expected_b)

    # The ledger credits both nodes; status reports them.
    status = subprocess.run([str(VENV_BIN / "echo-coordinator"), "status", "--data-dir", str(run_dir), "--json"],
                            capture_output=True, text=True, check=True)
    report = json.loads(status.stdout)
    assert report["version"] == STEPS and report["mode"] == "sequential"
    assert sorted(p["name"] for p in report["peers"]) == ["n1", "n2"]
    assert sum(p["accepted"] for p in report["peers"]) == 16 * STEPS  # evaluation answers are never trained on
    assert sum(p["eval_samples"] for p in report["peers"]) == 3 * (6 + 12)  # and are credited apart
    assert all(p["rejected"] == 0 and p["tokens"] > 0 for p in report["peers"])


def test_wrong_run_key_or_base_model_is_refused(tmp_path, tiny_model, processes):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", tiny_model, run_dir, task="arithmetic", steps=1)
    coordinator = spawn(processes, [str(VENV_BIN / "echo-coordinator"), "start", "--config", str(config)],
                        tmp_path / "coordinator.log")
    argv = join_argv(run_dir, coordinator)
    address, key = argv[2], argv[4]
    node = [str(VENV_BIN / "echo-node"), "join", address, "--data-dir", str(tmp_path / "n"), "--threads", "1"]

    wrong_key = "a" * len(key)
    out = subprocess.run([*node, "--run-key", wrong_key, "--model", str(tiny_model)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    assert f"is signed by key {key}, not the key {wrong_key}" in " ".join(out.stdout.split())

    other_model = build_tiny_gguf(tmp_path / "other.gguf", seed=1)
    out = subprocess.run([*node, "--run-key", key, "--model", str(other_model)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    assert "is not this run's base model" in " ".join(out.stdout.split())
    # A correct node joins and asks for work; the coordinator then names it to others as holding
    # the base (its peer id as the transport saw it); Ctrl-C ends it cleanly.
    proc = subprocess.Popen([*node, "--run-key", key, "--model", str(tiny_model), "--name", "carol"],
                            stdout=open(tmp_path / "carol.log", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    processes.append(proc)
    wait_for(lambda: "joined run" in (tmp_path / "carol.log").read_text(), 120, "carol to join", [proc])
    asker = SwarmDHT.start("127.0.0.1", 0, initial_peers=[address])
    try:
        assert len(asyncio.run(named_holders(asker, address, within=60))) == 1
    finally:
        asker.shutdown()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert "left the run" in (tmp_path / "carol.log").read_text()


async def named_holders(dht: SwarmDHT, address: str, within: float) -> tuple[str, ...]:
    """The peers the coordinator at `address` names as holding the base, once it names any."""
    endpoint = await dht.endpoint()
    async with asyncio.timeout(within):
        while not (named := (await endpoint.call_one(peer_of(address), rpc.HOLDERS, HoldersRequest(0))).peers):
            await asyncio.sleep(0.5)
    return named

"""Weight-update distribution: N nodes fetching one update, with and without peer relay.

Real hivemind peers on 127.0.0.1: the bench process is the trainer (a Relay serving a real
SmolLM2-135M full-mode update, with the trainer's upload budget when relay is on); each node is
a separate process running the node's own catch-up and relay code (verification included; no
model, since generation is not what is measured). Also reports what an update weighs against a
bf16 checkpoint: LoRA (r=16, all projections) as the run publishes it (a dense int4 delta against
the bf16 adapter nodes hold, and the bf16 snapshot late joiners start from) and full mode (top-k
int8 deltas). One optimiser step's change is Adam-like: every weight moves by about the learning rate.

    .venv/bin/python bench/broadcast.py [--sizes 1 2 4 8 16] [--density 0.01] [--lora-encoding dense-int4]

Prints a table and a final JSON line with, per N and relay setting, `trainer_upload_bytes`,
`update_bytes`, `all_nodes_on_version_seconds`, plus `bytes_ratio_lora` (the delta),
`bytes_ratio_lora_snapshot` and `bytes_ratio_full`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_coordinator.config import RunConfig  # noqa: E402


def build_updates(density: float, lora_encoding: str):
    """(run manifest, full-mode delta update, LoRA delta and snapshot bytes, bf16 checkpoint bytes)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from echo_coordinator.main import demo_model_path
    from echo_coordinator.publish import Publisher
    from echo_coordinator.trainer.learner import LORA_TARGETS
    from engines.hf import distinct_weights
    from protocols.messages import RunManifest, TaskSpec
    from protocols.signing import generate_key, public_bytes

    path = demo_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    base = distinct_weights(model)
    checkpoint_bf16 = 2 * sum(v.size for v in base.values())
    rng = np.random.default_rng(0)
    # One optimiser step's worth of change (Adam at lr 1e-5 moves every weight by ~1e-5).
    stepped = {k: v + (1e-5 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
    key = generate_key()
    publisher = Publisher("bench", key, "full", base, "topk-int8", density, snapshot_every=10**9)
    (delta_update, delta_store), = publisher.publish(1, stepped)
    lora = {}
    for name, value in base.items():
        if name.endswith(".weight") and name.split(".")[-2] in LORA_TARGETS:
            stem = "base_model.model." + name[: -len(".weight")]
            lora[stem + ".lora_A.weight"] = rng.standard_normal((16, value.shape[1])).astype(np.float32)
            lora[stem + ".lora_B.weight"] = rng.standard_normal((value.shape[0], 16)).astype(np.float32)
    lora_publisher = Publisher("bench", key, "lora", None, lora_encoding, density, snapshot_every=10**9)
    (_, snapshot_store), = lora_publisher.publish(1, lora)
    # Adam at lr 2e-4 (the LoRA default) moves every adapter weight by about 2e-4.
    stepped = {k: v + (2e-4 * np.sign(rng.standard_normal(v.shape))).astype(np.float32) for k, v in lora.items()}
    (_, lora_store), = lora_publisher.publish(2, stepped)
    lora_bytes = (sum(map(len, lora_store.values())), sum(map(len, snapshot_store.values())))
    manifest = RunManifest(
        run_id="bench", base_model=path.name, base_sha256="0" * 64, vocab_size=model.config.vocab_size,
        mode="sequential", update="full", staleness=1, task=TaskSpec("none"), group_size=1, max_new_tokens=1,
        temperature=1.0, run_key=public_bytes(key), trainer_addrs=(),
    )
    return manifest, (delta_update, delta_store), lora_bytes, checkpoint_bf16


async def trainer_round(n: int, relay_on: bool, update, manifest_path: Path, work: Path) -> dict:
    from echo_coordinator.presence import pick_holders
    from protocols import rpc
    from protocols.transport.dht import SwarmDHT
    from protocols.transport.relay import Relay
    from protocols.uploads import UploadBudget

    dht = SwarmDHT.start("127.0.0.1", 0)
    holding: dict[str, int] = {}  # peer -> version, as the coordinator learns it (from lease requests there)
    relay = Relay(budget=UploadBudget() if relay_on else None, peers_holding=lambda v: len(holding))
    relay.remember(*update)
    endpoint = await dht.endpoint()
    await relay.serve(endpoint)

    async def holders(request, peer: str):  # a HoldersRequest
        yield pick_holders(holding, frozenset(), {}, request.version, peer)

    await endpoint.serve(rpc.HOLDERS, holders)
    go = work / f"go-{n}-{relay_on}"
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--fetcher", dht.addresses()[0], str(manifest_path), str(go), str(int(relay_on))],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    ) for _ in range(n)]
    try:
        for p in procs:  # each prints READY once joined
            assert (await asyncio.to_thread(p.stdout.readline)).startswith("READY")
        started = time.time()
        go.touch()
        done = []
        for line in asyncio.as_completed([asyncio.to_thread(p.stdout.readline) for p in procs]):
            line = await line
            if not line.startswith("DONE"):
                raise SystemExit(f"a fetcher failed: {line!r}")
            _, at, peer = line.split()
            done.append(float(at))
            holding[peer] = 1
        return dict(nodes=n, relay=relay_on, trainer_upload_bytes=relay.bytes_served,
                    update_bytes=sum(map(len, update[1].values())), all_nodes_on_version_seconds=max(done) - started)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        dht.shutdown()


async def fetcher(address: str, manifest_path: str, go: str, relay_on: bool) -> None:
    """One node: join, wait for the go signal, catch up to version 1 (from the peers the trainer
    names, when relay is on), then say it holds it and keep serving until killed."""
    from echo_node.updates import UpdateError, catch_up
    from protocols import rpc
    from protocols.messages import HoldersRequest, RunManifest
    from protocols.multiaddr import peer_of
    from protocols.transport.dht import SwarmDHT
    from protocols.transport.relay import Relay

    manifest = RunManifest.from_wire(Path(manifest_path).read_bytes())
    dht = SwarmDHT.start("127.0.0.1", 0, [address])
    endpoint = await dht.endpoint()
    relay = Relay()
    await relay.serve(endpoint)
    trainer = peer_of(address)
    print("READY", flush=True)
    while not Path(go).exists():
        await asyncio.sleep(0.05)

    async def apply(update, store, payloads):
        relay.remember(update, store)

    async def peers(version: int) -> list[str]:
        if not relay_on:
            return []
        return list((await endpoint.call_one(trainer, rpc.HOLDERS, HoldersRequest(version))).peers)

    while True:
        try:
            await catch_up(endpoint, trainer, peers, manifest, 0, 1, apply, 120)
            break
        except UpdateError:
            await asyncio.sleep(0.2)  # the trainer said busy and no peer held it yet
    print(f"DONE {time.time()} {endpoint.peer_id}", flush=True)
    await asyncio.sleep(3600)


def main() -> None:
    if sys.argv[1:2] == ["--fetcher"]:
        asyncio.run(fetcher(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--density", type=float, default=RunConfig().update_density)
    parser.add_argument("--lora-encoding", default=RunConfig().lora_encoding)
    args = parser.parse_args()
    manifest, update, (lora_bytes, lora_snapshot_bytes), checkpoint = build_updates(args.density, args.lora_encoding)
    rows = []
    with tempfile.TemporaryDirectory(prefix="echo-broadcast-") as tmp:
        manifest_path = Path(tmp) / "manifest"
        manifest_path.write_bytes(manifest.to_wire())
        for n in args.sizes:
            for relay_on in (False, True):
                row = asyncio.run(trainer_round(n, relay_on, update, manifest_path, Path(tmp)))
                rows.append(row)
                print(f"N={n:<3} relay={'on ' if relay_on else 'off'} trainer upload "
                      f"{row['trainer_upload_bytes'] / row['update_bytes']:5.2f} updates, all nodes on version in "
                      f"{row['all_nodes_on_version_seconds']:.2f}s", flush=True)
    update_bytes = rows[0]["update_bytes"]
    print(json.dumps(dict(
        runs=rows, update_bytes=update_bytes, checkpoint_bf16_bytes=checkpoint,
        bytes_ratio_lora=round(lora_bytes / checkpoint, 4),
        bytes_ratio_lora_snapshot=round(lora_snapshot_bytes / checkpoint, 4),
        bytes_ratio_full=round(update_bytes / checkpoint, 4), lora_encoding=args.lora_encoding, density=args.density,
        upload_ratio_n16_relay=next((r["trainer_upload_bytes"] / update_bytes for r in rows
                                     if r["nodes"] == 16 and r["relay"]), None),
    )))


if __name__ == "__main__":
    main()

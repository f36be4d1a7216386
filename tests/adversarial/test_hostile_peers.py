"""Scripted malicious peers over the real transport against a real coordinator and an honest node.

The coordinator and the honest node are real processes (hivemind, llama.cpp, torch) on a tiny
Llama with peaked next-token distributions, like a trained model's, so two models' samples can
be told apart. The attackers run here, each with its own key, and hold the same model at the
run's current version (they fetch its adapter like any node could): an honest batch they build
is accepted (the control), every cheat on top of it is refused with a named reason. Afterwards:
no attacker is credited, the honest node is never refused or banned, the run finishes, and the
coordinator's memory did not grow with the flood."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hivemind.p2p import PeerID
from safetensors.numpy import load_file

from echo_node.schedule import set_paused
from engines.backend import generate_one
from engines.gguf_io import write_lora_adapter
from engines.llama_backend import LlamaBackend
from protocols import rpc, sampling
from protocols.errors import RemoteError, TransportError
from protocols.messages import (
    HoldersRequest, LeaseRequest, RolloutBatch, RolloutSample, RunManifest, TaskLease,
)
from protocols.signing import fingerprint, generate_key, public_bytes, sign_message
from protocols.multiaddr import peer_of
from protocols.transport.dht import SwarmDHT, record_key
from protocols.transport.streams import OK
from tasks import make_task
from tests.support.runs import VENV_BIN, join_argv, spawn, wait_for
from tests.support.tiny_model import build_tiny_gguf

T = 1.0
TOKEN_CHEATS = ("gold answer, made-up logprobs", "gold answer, teacher-forced logprobs", "another temperature",
                "one sample copied G times", "another model's text", "logprobs shaded down",
                "every 8th logprob shaded far")
# Honest tokens cut to shape: refused and struck; one written token in one sample: refused, and a
# strike only past the key's outlier budget (echo_coordinator.trust.OutlierBudget).
SHAPE_CHEATS = ("honest tokens, cut short", "one sample's answer edited")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Attacker:
    """What a malicious volunteer has: a DHT peer and streams, keys, and the run's model."""

    def __init__(self, endpoint, coordinator: str, manifest: RunManifest, model: Path, other: Path, run_dir: Path,
                 work: Path):
        self.endpoint, self.coordinator, self.manifest = endpoint, coordinator, manifest
        self.backend = LlamaBackend(model, threads=1, n_ctx=256)
        self.other = LlamaBackend(other, threads=1, n_ctx=256)
        self.run_dir, self.work, self.version = run_dir, work, 0
        self.task = make_task("arithmetic")
        self.lock = asyncio.Lock()  # one llama context: generate for one cheat at a time

    async def lease(self, key, tries: int = 300) -> TaskLease:
        for _ in range(tries):
            reply = await self.ask(key)
            if isinstance(reply, TaskLease):
                return reply
            await asyncio.sleep(0.3)
        raise AssertionError("no lease")

    async def ask(self, key):
        request = sign_message(LeaseRequest(self.manifest.run_id, public_bytes(key), self.endpoint.peer_id, "mallory",
                                            0, 64, time.time()), key)
        return await self.call(rpc.LEASE, request)

    async def push(self, batch: RolloutBatch) -> str:
        try:
            return "accepted" if (await self.call(rpc.PUSH, batch.to_wire())).accepted else "none"
        except RemoteError as e:
            return e.code

    async def call(self, what: rpc.Rpc, request: bytes) -> bytes:
        """Our attackers share one libp2p peer, so they meet the per-peer limit (`busy`, or a reset
        stream when the refusal beats our request): wait and call again, as a node would."""
        for _ in range(100):
            try:
                return await self.endpoint.call_one(self.coordinator, what, request)
            except RemoteError as e:
                if e.code != "busy":
                    raise
            except TransportError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"{what.name} stayed busy")

    def at_version(self, version: int) -> None:
        """Hold the run's weights at `version`: the adapter the trainer published (any node has it)."""
        if version == self.version:
            return
        path = self.work / f"v{version}.gguf"
        adapter = load_file(str(self.run_dir / "adapters" / f"v{version}.safetensors"))
        b = self.backend
        write_lora_adapter(adapter, float(self.manifest.update_params["alpha"]), path, b.layout)
        b.set_adapter(path)
        self.version = version

    def honest(self, lease: TaskLease, backend=None, temperature: float = T) -> list[RolloutSample]:
        """The batch an honest node holding this version sends for the lease."""
        self.at_version(lease.version)
        samples = []
        for seed, prompt in zip(lease.seeds, lease.prompts):
            for j in range(self.manifest.group_size):
                noise = sampling.sample_seed(lease.noise_id, seed, j)
                out = generate_one(backend or self.backend, prompt, self.manifest.max_new_tokens, temperature, noise)
                samples.append(RolloutSample(seed, prompt, out.token_ids, out.logprobs))
        return samples

    def teacher_forced(self, prompt, ids) -> tuple[float, ...]:
        """The model's own logprobs of tokens it did not choose (a forger's best cover)."""
        logits = self.backend.batch.logits_of(list(prompt) + list(ids)[:-1])
        rows = logits[len(prompt) - 1 :].astype(np.float64) / T
        return tuple(float(x) for x in sampling.log_softmax(rows)[np.arange(len(ids)), ids])

    def gold(self, seed: int) -> tuple[int, ...]:
        """The gold answer, ended as a sampled turn ends (its end-of-turn token, or the limit)."""
        text = tuple(self.backend.tokenize(f"The answer is {self.task.generate(seed).answer}."))
        return (text + (self.backend.eos,))[: self.manifest.max_new_tokens]

    def cheat(self, name: str, lease: TaskLease) -> list[RolloutSample]:
        honest = self.honest(lease)
        if name == "gold answer, made-up logprobs":
            return [dataclasses.replace(s, completion_ids=self.gold(s.seed), logprobs=(-0.01,) * len(self.gold(s.seed)))
                    for s in honest]
        if name == "gold answer, teacher-forced logprobs":
            return [dataclasses.replace(s, completion_ids=self.gold(s.seed),
                                        logprobs=self.teacher_forced(s.prompt_ids, self.gold(s.seed))) for s in honest]
        if name == "another temperature":
            return self.honest(lease, temperature=T / 4)
        if name == "one sample copied G times":
            g = self.manifest.group_size
            return [honest[i - i % g] for i in range(len(honest))]
        if name == "another model's text":
            return self.honest(lease, backend=self.other)
        if name == "logprobs shaded down":
            return [dataclasses.replace(s, logprobs=tuple(x - 1.0 for x in s.logprobs)) for s in honest]
        if name == "every 8th logprob shaded far":  # the pooled mean stays honest-looking; these train at the TIS cap
            flat = [x - 0.6 if i % 8 == 7 else x for i, x in enumerate(x for s in honest for x in s.logprobs)]
            out, start = [], 0
            for s in honest:
                out.append(dataclasses.replace(s, logprobs=tuple(flat[start : start + len(s.logprobs)])))
                start += len(s.logprobs)
            return out
        if name == "honest tokens, cut short":  # e.g. right after the gold number
            return [dataclasses.replace(s, completion_ids=s.completion_ids[:2], logprobs=s.logprobs[:2]) for s in honest]
        if name == "one sample's answer edited":
            # Its last token replaced by the one the model likes least, with its true logprob.
            first = honest[0]
            prompt, ids = first.prompt_ids, first.completion_ids
            row = self.backend.batch.logits_of(list(prompt) + list(ids)[:-1])[-1]
            edited = ids[:-1] + (int(np.argmin(row)),)
            return [dataclasses.replace(first, completion_ids=edited, logprobs=self.teacher_forced(prompt, edited)),
                    *honest[1:]]
        raise ValueError(name)

    def batch(self, key, lease: TaskLease, samples) -> RolloutBatch:
        return sign_message(RolloutBatch(self.manifest.run_id, lease.lease_id, lease.version, public_bytes(key),
                                         tuple(samples), created=time.time()), key)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return build_tiny_gguf(d / "run.gguf", init_std=0.5), build_tiny_gguf(d / "other.gguf", seed=1, init_std=0.5)


def test_hostile_peers_are_refused_and_the_run_goes_on(tmp_path, models, processes):  # noqa: F811
    model, other = models
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
model = "{model}"
task = "arithmetic"
steps = 8
prompts_per_step = 8
group_size = 4
max_new_tokens = 8
temperature = {T}
min_nodes = 1
port = 0
data_dir = "{run_dir}"
lease_seconds = 20

[trainer]
lora_rank = 4
learning_rate = 0.01
micro_batch_tokens = 512
threads = 1
""")
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)],
                        tmp_path / "coordinator.log")
    argv = join_argv(run_dir, coordinator)
    address, run_fp = argv[2], argv[4]
    node = [str(VENV_BIN / argv[0]), *argv[1:], "--threads", "1"]
    # The honest node joins and announces, but takes no lease until the attacks are done: with
    # shadow leases nothing the attackers hold slows it, and the run was over before they were.
    set_paused(tmp_path / "honest", True)
    honest = spawn(processes, [*node, "--name", "honest", "--data-dir", str(tmp_path / "honest")], tmp_path / "honest.log")

    attacker_dht = SwarmDHT.start("127.0.0.1", 0, [address])  # no validator: it stores whatever it likes
    results: dict[str, str] = {}
    replayed: dict[str, object] = {}  # the control batch's key and sample count

    async def attack() -> tuple[float, float]:
        endpoint = await attacker_dht.endpoint()
        coordinator_peer = peer_of(address)
        manifest = await endpoint.call_one(coordinator_peer, rpc.MANIFEST)
        mallory = Attacker(endpoint, coordinator_peer, manifest, model, other, run_dir, tmp_path)

        # The control: an honest batch built by the attackers' own machinery is accepted.
        key = generate_key()
        lease = await mallory.lease(key)
        async with mallory.lock:
            control = mallory.batch(key, lease, mallory.honest(lease))
        results["control: honest batch"] = await mallory.push(control)
        results["replayed batch"] = await mallory.push(control)  # told again it was taken: taken once
        replayed.update(node=fingerprint(control.node_key), samples=len(control.samples))

        async def token_cheat(name: str) -> None:
            key = generate_key()
            lease = await mallory.lease(key)
            async with mallory.lock:
                batch = mallory.batch(key, lease, mallory.cheat(name, lease))
            results[name] = await mallory.push(batch)
            # A key that failed verification is banned: its next request is refused as such.
            try:
                await mallory.ask(key)
                results[name + " / then"] = "served"
            except RemoteError as e:
                results[name + " / then"] = e.code

        await asyncio.gather(*(token_cheat(name) for name in (*TOKEN_CHEATS, *SHAPE_CHEATS)))

        # Forged: a batch whose signature does not match what it carries.
        key = generate_key()
        lease = await mallory.lease(key)
        async with mallory.lock:
            good = mallory.batch(key, lease, mallory.honest(lease))
        first = good.samples[0]
        forged = dataclasses.replace(good, samples=(dataclasses.replace(first, logprobs=(0.0,) * len(first.logprobs)),
                                                    *good.samples[1:]))
        results["forged batch"] = await mallory.push(forged)
        # Another node's lease: a thief signs a batch for the lease this key holds.
        thief = generate_key()
        results["another node's lease"] = await mallory.push(mallory.batch(thief, lease, good.samples))
        results["lease holder after the thief"] = await mallory.push(good)

        # Hoarding, then a flood. Both leases must still be out when the third is asked for: work
        # can run short while other attackers hold it, and a new key's lease lives 5 s (a quarter
        # of 20): if one runs out first, the key is shut out for lapsing, so start again with a new one.
        while True:
            hoarder = generate_key()
            try:
                held = [await mallory.lease(hoarder), await mallory.lease(hoarder)]
            except RemoteError as e:
                if e.code != "lapsed":
                    raise
                continue
            if min(x.expires_at for x in held) - time.time() > 1:
                break
        try:
            reply = await mallory.ask(hoarder)
            results["third lease"] = f"served: {reply!r}"
        except RemoteError as e:
            results["third lease"] = e.code
        codes = []
        for _ in range(40):
            try:
                await mallory.ask(hoarder)
            except RemoteError as e:
                codes.append(e.code)
        results["lease request flood"] = "rate_limited" if "rate_limited" in codes else ",".join(set(codes))
        del held
        # Fresh keys, one request each, in three rounds of 300: the median round's growth is what the
        # keys cost (a training step or an evaluation in the same moment raises the RSS once).
        growth = []
        for _ in range(3):
            before = rss_mb(coordinator.pid)
            for _ in range(300):
                await mallory.ask(generate_key())
            growth.append(rss_mb(coordinator.pid) - before)

        # Frames: one that claims 1 GiB, and one cut short.
        for name, write in (("oversize frame", lambda w: w.write((2**30).to_bytes(8, "big") + OK)),
                            ("truncated frame", lambda w: w.write((1000).to_bytes(8, "big") + OK + b"partial"))):
            _, reader, writer = await endpoint.p2p.call_binary_stream_handler(
                PeerID.from_base58(coordinator_peer), rpc.PUSH.name)
            write(writer)
            await writer.drain()
            writer.close()
            results[name] = "sent"
        # Forged DHT records: a manifest under the run's key signed by another key, and records
        # under the peers key nodes once announced in (a stale node would still read it).
        rogue = generate_key()
        fake_manifest = sign_message(dataclasses.replace(manifest, run_key=public_bytes(rogue), trainer_addrs=()), rogue)
        await attacker_dht.put(record_key(run_fp, "manifest"), fake_manifest.to_wire(), 3600)
        for value in (b"", b"\x00" * 512):
            await attacker_dht.put(record_key(run_fp, "peers"), value, 3600, subkey=fingerprint(public_bytes(rogue)))
        # Fresh keys claim the base (version 0) in their lease requests, from a peer that serves
        # no chunk: the late node, joining without --model, is pointed at it.
        for _ in range(3):
            await mallory.ask(generate_key())
        return growth, endpoint.peer_id

    async def holders_named(watcher: SwarmDHT) -> tuple[str, ...]:
        endpoint = await watcher.endpoint()
        for _ in range(20):
            named = await endpoint.call_one(peer_of(address), rpc.HOLDERS, HoldersRequest(0))
            if named.peers:
                return named.peers
            await asyncio.sleep(0.5)
        return ()

    try:
        growth, mallory_peer = asyncio.run(attack())
        # Every peer of the run validates: the forged records exist only in the attacker's own store.
        watcher = SwarmDHT.start("127.0.0.1", 0, [address], run_fingerprint=run_fp)
        try:
            found = asyncio.run(watcher.get(record_key(run_fp, "manifest")))
            assert fingerprint(RunManifest.from_wire(found).run_key) == run_fp
            assert asyncio.run(watcher.get(record_key(run_fp, "peers"))) is None
            assert mallory_peer in asyncio.run(holders_named(watcher))  # a claim, named as one
        finally:
            watcher.shutdown()
        # A node joining after the forgeries and the claims joins and works.
        set_paused(tmp_path / "honest", False)
        late = spawn(processes, [*node, "--name", "late", "--data-dir", str(tmp_path / "late")], tmp_path / "late.log")
        wait_for(lambda: "joined run" in (tmp_path / "late.log").read_text(), 120, "the late node to join", [late])
        assert coordinator.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        assert honest.wait(timeout=60) == 0 and late.wait(timeout=60) == 0
    finally:
        attacker_dht.shutdown()

    print(json.dumps(results, indent=1))
    assert results["control: honest batch"] == "accepted"
    assert results["replayed batch"] == "accepted"  # (as a node sending again a push whose answer it lost)
    for name in TOKEN_CHEATS:
        assert results[name] in ("bad_sampling", "bad_logprobs"), (name, results[name])
        assert results[name + " / then"] == "banned"
    assert results["logprobs shaded down"] == results["every 8th logprob shaded far"] == "bad_logprobs"
    assert (results["honest tokens, cut short"], results["honest tokens, cut short / then"]) == ("truncated", "banned")
    assert (results["one sample's answer edited"], results["one sample's answer edited / then"]) == ("outlier", "served")
    assert results["gold answer, teacher-forced logprobs"] == "bad_sampling"
    assert results["forged batch"] == "bad_signature"
    assert results["another node's lease"] == "bad_lease"
    assert results["lease holder after the thief"] == "accepted"
    assert results["third lease"] == "lease_limit"
    assert results["lease request flood"] == "rate_limited"
    assert sorted(growth)[1] < 15, f"coordinator RSS grew {growth} MB over three rounds of 300 fresh keys"

    from echo_coordinator.ledger import Ledger

    ledger = Ledger(run_dir / "ledger.sqlite")
    rows = ledger.peers()
    ledger.close()
    (honest_row,) = [p for p in rows if p["name"] == "honest"]
    assert honest_row["rejected"] == 0 and honest_row["failed_batches"] == 0
    assert honest_row["banned_until"] == 0 and honest_row["accepted"] > 0
    cheaters = [p for p in rows if p["name"] not in ("honest", "late")]
    assert sum(p["failed_batches"] for p in cheaters) == len(TOKEN_CHEATS) + 1  # and the cut one
    (edited,) = [p for p in cheaters if "outlier" in p["rejected_by_reason"]]  # refused, not (yet) struck
    assert (edited["accepted"], edited["failed_batches"], edited["banned_until"]) == (0, 0, 0)
    # Credit went only to the keys that sent honest batches (the control and the lease holder).
    assert all(p["failed_batches"] == 0 and p["rejected_by_reason"].keys() <= {"bad_lease"}
               for p in cheaters if p["accepted"])
    # The replayed batch was credited once, and charged nothing.
    (control_row,) = [p for p in rows if p["node_id"] == replayed["node"]]
    assert (control_row["accepted"], control_row["rejected"]) == (replayed["samples"], 0)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 8

"""A coordinator's network side in the test process, for hostile peers to call over the real
transport: a real `RunService` (SQLite ledger and journal, leasing, pushes, policing with the real
`Verifier` on a toy model, run on a real `TorchThread`), its stream handlers
(`echo_coordinator.handlers`) and relay on a real hivemind DHT peer on 127.0.0.1, and its DHT
presence (`echo_coordinator.presence`), which learns who holds what from lease requests. What it lacks
is the trainer: a test publishes versions itself (`publish`) and holds the torch thread busy as a
training step would (`TorchThread.call`). Starts in about a second; a whole coordinator takes 15.

`Peer`s are what attackers (and honest nodes) call it from: bare libp2p peers, one id each.

The toy model is context-free: every position's logits are `LOGITS`, over a 1000-token
vocabulary whose ids "decode" to their numbers. `sampled_batch` is what an honest node running
it sends; the verifier checks pushes against the same logits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from echo_coordinator.handlers import register_handlers
from echo_coordinator.ledger import Ledger
from echo_coordinator.presence import Presence
from echo_coordinator.publish import Publisher
from echo_coordinator.service import LeaseSettings, Policing, RunService, Work
from echo_coordinator.torch_thread import TorchThread
from echo_coordinator.verify import Verifier
from engines.episodes import Transcripts
from engines.sampler import score_rows
from protocols import rpc
from protocols.messages import LeaseRequest, RolloutBatch, RolloutSample, TaskLease, TurnFormat
from protocols.sampling import SampleEvidence, SamplingRule, choose, gumbel, log_softmax, sample_seed
from protocols.signing import fingerprint, generate_key, public_bytes, sign_message
from protocols.transport.dht import SwarmDHT
from protocols.transport.relay import Relay
from protocols.transport.streams import Endpoint
from protocols.uploads import UploadBudget
from tasks import make_task
from tests.unit.protocols import factories

EOS = 999  # a completion ends at it (or at 8 tokens)
GROUP = 2
LOGITS = np.random.default_rng(0).normal(size=1000) * 3
TRANSCRIPTS = Transcripts(decode=lambda ids: " ".join(str(i) for i in ids),
                          encode=lambda text: [int(t) for t in text.split()], eos=EOS, turns=TurnFormat(), max_new_tokens=8)
ADAPTER = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((2, 4), np.float32)}


def toy_evidence(samples, seeds, weights):
    """What the trainer's forward pass yields for these samples, on the toy model."""
    out = []
    for s, seed in zip(samples, seeds):
        n = len(s.completion_ids)
        m, trainer = score_rows(np.tile(LOGITS, (n, 1)).astype(np.float32), [seed] * n, np.arange(n),
                                np.array(s.completion_ids))
        out.append(SampleEvidence.of(m, trainer, np.array(s.behaviour)))
    return out


def sampled_batch(run_id: str, key, lease: TaskLease) -> RolloutBatch:
    """What an honest node running the toy model sends: Gumbel-max with the lease's noise, up to
    the end-of-turn token or the 8-token limit."""
    samples = []
    for seed, prompt in zip(lease.seeds, lease.prompts):
        for j in range(GROUP):
            ids: tuple[int, ...] = ()
            for g in gumbel(sample_seed(lease.noise_id, seed, j), np.arange(8), len(LOGITS)):
                ids += (choose(LOGITS, g),)
                if ids[-1] == EOS:
                    break
            samples.append(RolloutSample(seed, prompt, ids, tuple(float(log_softmax(LOGITS)[i]) for i in ids)))
    return sign_message(RolloutBatch(run_id, lease.lease_id, lease.version, public_bytes(key), tuple(samples),
                                     created=time.time()), key)


class LiveService:
    """`async with LiveService(tmp_path, ...) as coordinator:`; `coordinator.peer` is its libp2p
    peer id, `coordinator.address` its multiaddr. `budget`: the relay's upload budget (None: as
    the coordinator builds it, `UploadBudget(trainer_upload_copies=2)`)."""

    def __init__(self, tmp_path: Path, mode: str = "sequential", settings: LeaseSettings | None = None,
                 budget: UploadBudget | None = None, seeds: int = 100, reach: bool = False):
        self.tmp_path, self.mode, self.seeds = tmp_path, mode, seeds
        self.reach = reach  # answer `echo.reach` as the coordinator does (a real node's join asks it)
        self.prober = None
        self.settings = settings or LeaseSettings(lease_seconds=60, seeds_per_lease=1)
        self.budget = budget if budget is not None else UploadBudget(2)
        self.key = generate_key()
        self.fp = fingerprint(public_bytes(self.key))
        self.torch = TorchThread()
        self.verifying = 0  # pushes that reached verification (waiting for the torch thread, or done)

    async def __aenter__(self) -> LiveService:
        self.dht = SwarmDHT.start("127.0.0.1", 0, run_fingerprint=self.fp)
        self.address = next(a for a in self.dht.addresses() if "/ip4/127.0.0.1/" in a)
        self.manifest = sign_message(factories.manifest(
            run_key=public_bytes(self.key), group_size=GROUP, max_new_tokens=8, vocab_size=1000, mode=self.mode,
            staleness=1, trainer_addrs=(self.address,), created=time.time()), self.key)
        self.ledger = Ledger(self.tmp_path / "ledger.sqlite")

        def run(fn, behind=False):  # verification on the torch thread, as the coordinator's Verifier does it
            self.verifying += 1
            return self.torch.run(fn, behind)

        self.verifier = Verifier(toy_evidence, SamplingRule(), keep_versions=2, run=run)
        self.verifier.remember(0, {})
        self.presence = Presence(self.dht, self.fp)
        work = Work(make_task("arithmetic"), render_prompt=lambda seed: (1, 2, 3 + seed % 50), transcripts=TRANSCRIPTS)
        self.service = RunService(self.manifest, self.key, self.ledger, work, self.settings, Policing(self.verifier),
                                  Relay(budget=self.budget, peers_holding=self.presence.holding))
        if self.mode == "sequential":
            self.service.open_step(list(range(self.seeds)))
        self.service.begin()
        endpoint = await self.dht.endpoint()
        self.peer = endpoint.peer_id
        if self.reach:
            from protocols.transport.reach import Prober

            self.prober = Prober("127.0.0.1", self.address)
            await self.prober.start()
        await register_handlers(endpoint, self.service, self.presence, prober=self.prober)
        self.refresh = asyncio.create_task(self.presence.refresh(self.manifest, self.service), name="dht-refresh")
        return self

    async def __aexit__(self, *exc) -> None:
        self.refresh.cancel()
        await asyncio.gather(self.refresh, return_exceptions=True)
        if self.prober is not None:
            await self.prober.close()
        self.dht.shutdown()
        self.torch.shutdown()
        self.ledger.close()

    async def refreshed(self, within: float = 30.0) -> None:
        """Until the presence has looked again at who holds what (`Presence.refresh` replaces its
        reading whole): what lease requests answered before this call said is in it then."""
        before = self.presence.peer_versions
        try:
            async with asyncio.timeout(within):
                while self.presence.peer_versions is before:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"the presence did not look again within {within} s") from None

    def publish(self, version: int = 1) -> dict[str, bytes]:
        """Version `version` of a LoRA run (a first snapshot), as the trainer publishes it; its chunks."""
        [(update, chunks)] = Publisher(self.manifest.run_id, self.key, "lora", None, "topk-int8", 0.05, 10,
                                       {"alpha": 8.0}).publish(version, ADAPTER)
        self.service.publish([(update, chunks)])
        self.verifier.remember(version, {})
        return chunks


class Peer:
    """A bare libp2p peer (its own id) with our streams: `await Peer.start(address)`."""

    def __init__(self, p2p):
        self.p2p, self.endpoint = p2p, Endpoint(p2p)
        self.peer_id = self.endpoint.peer_id

    @classmethod
    async def start(cls, address: str) -> Peer:
        from hivemind.p2p import P2P

        return cls(await P2P.create(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"]))

    @classmethod
    async def many(cls, address: str, count: int) -> list[Peer]:
        return list(await asyncio.gather(*(cls.start(address) for _ in range(count))))

    async def shutdown(self) -> None:
        await self.p2p.shutdown()

    def lease_request(self, service: LiveService, key, name: str = "mallory", version: int = 0) -> LeaseRequest:
        return sign_message(LeaseRequest(service.manifest.run_id, public_bytes(key), self.peer_id, name, version, 64,
                                         time.time()), key)

    async def ask(self, service: LiveService, key, timeout: float | None = None, name: str = "mallory",
                  version: int = 0):
        """A lease request signed by `key`, saying it holds `version`, over the real stream: the
        TaskLease or NoWork. A stream that breaks before any answer is asked once more
        (`idempotent`), as a node asks again: a fresh loopback stream now and then resets before
        its first frame."""
        return await self.endpoint.call_one(service.peer, rpc.LEASE, self.lease_request(service, key, name, version),
                                            idempotent=True, timeout=timeout)

"""A node's parts on one event loop, with no network: a session, and a trainer that serves a real
`Relay`'s updates and base model to the real catch-up and download code."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from echo_coordinator.publish import Publisher
from echo_node.config import NodeConfig
from echo_node.session import Session
from protocols import rpc
from protocols.errors import TransportError
from protocols.messages import Chunk, Holders
from protocols.signing import generate_key, public_bytes
from protocols.transport.relay import Relay
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id

ADDRESS = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id('Coordinator')}"


def config(tmp_path, **kw) -> NodeConfig:
    return NodeConfig(**{"address": ADDRESS, "run_key": "a" * 26, "model": tmp_path / "m.gguf",
                         "data_dir": tmp_path / "node", **kw})


@pytest.fixture
def session(tmp_path) -> Session:
    return Session(config(tmp_path))


class RelayTrainer:
    """An endpoint whose every peer is the trainer's `relay`: what `catch_up` asks of the trainer
    and of peers over streams, answered from it. `fail`: errors its chunk calls raise first."""

    peer_id = peer_id("Node")

    def __init__(self, relay: Relay, *fail: Exception):
        self.relay, self.fail, self.calls = relay, list(fail), []

    async def call_one(self, peer, handler, request=None, idempotent=False, timeout=None):
        self.calls.append(handler.name)
        if handler == rpc.HOLDERS:
            return Holders(())  # nobody else holds it: the trainer serves
        if handler == rpc.UPDATES:
            return self.relay.index()
        if handler == rpc.UPDATE:
            found = self.relay.manifest(request.from_version, request.to_version)
            if found is None:
                raise TransportError(f"no update {request.from_version}->{request.to_version}")
            return found
        raise AssertionError(f"unexpected call {handler.name}")

    async def call(self, peer, handler, request, on_reply=None, timeout=None):
        assert handler == rpc.CHUNKS
        self.calls.append(handler.name)
        if self.fail:
            raise self.fail.pop(0)
        for digest in request.digests:
            data = self.relay.chunk(digest)
            if data is not None:
                await on_reply(Chunk(digest, data))
        return []


def full_run(versions: int):
    """A full-mode run published to `versions`: (base weights, the trainer's relay, its manifest,
    the view up-to-date nodes hold)."""
    key = generate_key()
    base = {"w": np.arange(256, dtype=np.float32), "b": np.ones(8, np.float32)}
    publisher = Publisher("run-1", key, "full", base, "topk-int8", 0.25, snapshot_every=100, chunk_size=256)
    relay = Relay(keep_versions=100)
    for version in range(1, versions + 1):
        for update, store in publisher.publish(version, {k: v + version for k, v in base.items()}):
            relay.remember(update, store)
    manifest = factories.manifest(run_key=public_bytes(key), update="full", mode="async", staleness=4)
    return base, relay, manifest, publisher.view()


class Backend(SimpleNamespace):
    """What the node asks of a backend besides generation: its name, throughput, weights."""

    def __init__(self):
        # model_path: the file it serves (this one stands in: full mode sizes its exports by it)
        super().__init__(name="llama_cpp", throughput=12.0, hardware="cpu", parallel=8, loads=[],
                         model_path=Path(__file__))

    def load_weights(self, master, version, workdir):
        self.loads.append((version, {k: v.copy() for k, v in master.items()}))

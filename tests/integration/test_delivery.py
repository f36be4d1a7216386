"""Weight delivery over real hivemind streams against providers that misbehave: every failure
leaves the node on its last good version, and an honest provider still gets the update through."""

import asyncio
import dataclasses

import numpy as np
import pytest

from echo_coordinator.publish import Publisher
from echo_node.updates import UpdateError, apply_update, catch_up, check_manifest, shapes
from protocols import rpc
from protocols.transport.relay import Relay
from protocols.signing import generate_key, public_bytes, sign_message
from protocols.transport.dht import SwarmDHT
from protocols.transport.streams import OK, write_frame
from tests.support.runs import named
from tests.unit.protocols import factories


@pytest.fixture
def swarm():
    peers = [SwarmDHT.start("127.0.0.1", 0)]
    peers += [SwarmDHT.start("127.0.0.1", 0, initial_peers=peers[0].addresses()) for _ in range(3)]
    yield peers
    for p in peers:
        p.shutdown()


def published_updates():
    key = generate_key()
    base = {"w": np.arange(4096, dtype=np.float32)}
    publisher = Publisher("run-1", key, "full", base, "topk-int8", 0.25, snapshot_every=100, chunk_size=512)
    updates = [publisher.publish(v, {"w": base["w"] + v})[0] for v in (1, 2)]
    return base, updates, factories.manifest(run_key=public_bytes(key), update="full")


class Node:
    """The node side of catch_up: master weights and the versions it applied."""

    def __init__(self, base):
        self.master, self.version, self.applied = {k: v.copy() for k, v in base.items()}, 0, []

    async def apply(self, update, store, payloads):
        self.master.update(apply_update(self.master, update, payloads))
        self.version = update.to_version
        self.applied.append(update.to_version)


class Replaying(Relay):
    """Offers 1 -> 2 honestly in its index, then answers with the validly signed 0 -> 1 manifest."""

    def manifest(self, from_version, to_version):
        return self.updates[0, 1][0]


async def serve(dht, updates, relay=None) -> str:
    relay = relay or Relay(keep_versions=10)
    for update, store in updates:
        relay.remember(update, store)
    endpoint = await dht.endpoint()
    await relay.serve(endpoint)
    return endpoint.peer_id


async def broken_chunk_server(dht, vanish: bool) -> str:
    """A peer whose chunk stream breaks mid-transfer: a garbage frame, half a frame, then the
    stream ends (or, with `vanish`, the whole peer goes away)."""
    endpoint = await dht.endpoint()

    async def broken(info, reader, writer):
        await reader.read(8)
        await write_frame(writer, OK, b"\x81" * 10)
        writer.write((1000).to_bytes(8, "big") + b"\0partial")
        await writer.drain()
        if vanish:
            dht.shutdown()
        writer.close()

    await endpoint.p2p.add_binary_stream_handler(rpc.CHUNKS.name, broken)
    return endpoint.peer_id


async def stalling_chunk_server(dht) -> str:
    """A peer that takes chunk requests and never answers."""
    endpoint = await dht.endpoint()

    async def stall(info, reader, writer):
        await reader.read(8)
        await asyncio.sleep(3600)

    await endpoint.p2p.add_binary_stream_handler(rpc.CHUNKS.name, stall)
    return endpoint.peer_id


def test_relay_peer_first_then_trainer_for_what_the_peer_lacks(swarm):
    base, updates, manifest = published_updates()

    async def go():
        trainer = await serve(swarm[0], updates)
        peer = await serve(swarm[1], updates[:1])  # has version 1 only
        node, endpoint = Node(base), await swarm[3].endpoint()
        await catch_up(endpoint, trainer, named(peer), manifest, 0, 2, node.apply, 30)
        assert node.applied == [1, 2]

    asyncio.run(go())


def test_broken_peer_mid_transfer_falls_back_to_the_trainer(swarm):
    base, updates, manifest = published_updates()

    async def go():
        trainer = await serve(swarm[0], updates)
        bad = await broken_chunk_server(swarm[1], vanish=False)
        node, endpoint = Node(base), await swarm[3].endpoint()
        await catch_up(endpoint, trainer, named(bad), manifest, 0, 2, node.apply, 30)
        assert node.applied == [1, 2]

    asyncio.run(go())


@pytest.mark.parametrize("fault, reason", [
    ("tampered chunk", "chunks unavailable"), ("forged manifest", "does not verify"),
    ("replayed manifest", "asked for update"), ("truncated stream", "chunks unavailable"),
    ("vanishing provider", "chunks unavailable"), ("stalling provider", "chunks unavailable"),
])
def test_faulty_provider_leaves_node_on_good_version(swarm, fault, reason):
    base, updates, manifest = published_updates()
    (first, first_store), (second, second_store) = updates

    async def go():
        node, endpoint = Node(base), await swarm[3].endpoint()
        # Version 1 arrives honestly first, so "a good version" is a real one, not the base.
        await catch_up(endpoint, await serve(swarm[0], updates[:1]), named(), manifest, 0, 1, node.apply, 30)
        good = node.master["w"].copy()

        peers, relay = [], None
        if fault == "tampered chunk":
            served = [(second, {d: b"\0" + data[1:] for d, data in second_store.items()})]
        elif fault == "forged manifest":
            served = [(sign_message(dataclasses.replace(second, created=second.created + 1), generate_key()), second_store)]
        elif fault == "replayed manifest":
            served, relay = updates, Replaying(keep_versions=10)
        elif fault == "stalling provider":  # its own peer: "vanishing provider" takes swarm[2] down
            served = [(second, {})]
            staller = SwarmDHT.start("127.0.0.1", 0, swarm[0].addresses())
            peers = [await stalling_chunk_server(staller)]
        else:  # the trainer offers the manifest but not the chunks; the one peer holding them breaks
            served = [(second, {})]
            peers = [await broken_chunk_server(swarm[2], vanish=fault == "vanishing provider")]
        trainer = await serve(swarm[1], served, relay)

        with pytest.raises(UpdateError, match=reason):
            await catch_up(endpoint, trainer, named(*peers), manifest, 1, 2, node.apply, 5)
        assert node.version == 1 and node.applied == [1] and node.master["w"].tobytes() == good.tobytes()
        if fault == "stalling provider":
            staller.shutdown()

        # Still serving: an honest provider completes the update.
        honest = SwarmDHT.start("127.0.0.1", 0, swarm[0].addresses())
        try:
            await catch_up(endpoint, await serve(honest, updates), named(), manifest, 1, 2, node.apply, 30)
        finally:
            honest.shutdown()
        assert node.applied == [1, 2]

    asyncio.run(go())


def test_a_manifest_declaring_more_bytes_than_its_shape_takes_is_refused_before_any_chunk(swarm):
    """The coordinator's own signed manifest lists 20 chunks of 512 bytes for a 4,096-value
    tensor whose topk-int8 payload takes at most 20,488 bytes... then ten times that: the node
    refuses it from the manifest alone, without asking anyone for a chunk (a real one could list
    ~250k chunks of 8 MiB, all fetched into memory before any check)."""
    key = generate_key()
    base = {"w": np.arange(4096, dtype=np.float32)}
    publisher = Publisher("run-1", key, "full", base, "topk-int8", 0.25, snapshot_every=100, chunk_size=512)
    (update, store), = publisher.publish(1, {"w": base["w"] + 1})
    manifest = factories.manifest(run_key=public_bytes(key), update="full")
    entry = update.tensors[0]
    n_chunks = 10 * 20_488 // 512
    inflated = dataclasses.replace(entry, nbytes=n_chunks * 512, chunks=entry.chunks * (n_chunks // len(entry.chunks) + 1))
    inflated = dataclasses.replace(inflated, chunks=inflated.chunks[:n_chunks])
    bomb = sign_message(dataclasses.replace(update, tensors=(inflated,)), key)

    async def go():
        relay = Relay(keep_versions=10)
        trainer = await serve(swarm[0], [(bomb, store)], relay)
        node, endpoint = Node(base), await swarm[3].endpoint()
        with pytest.raises(UpdateError, match="takes at most 20,488"):
            await catch_up(endpoint, trainer, named(), manifest, 0, 1, node.apply, 5,
                           check=lambda u: check_manifest(shapes(node.master), u, None))
        assert relay.bytes_served == 0 and node.applied == []

    asyncio.run(go())

"""Peers that abuse the streams themselves, against a node's real fetch code over real hivemind
streams on 127.0.0.1 (issue 23 items 3 and 12): a provider that takes a chunk request and
sends nothing, and a coordinator whose one-reply answers never end."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from echo_coordinator.publish import Publisher
from echo_node import updates
from echo_node.base_download import fetch_model_file
from echo_node.join import CALL_TIMEOUT
from protocols import rpc
from protocols.errors import TransportError
from protocols.signing import generate_key, public_bytes, sign_message
from protocols.transport.relay import Relay
from protocols.transport.streams import Endpoint
from tests.support.live_service import Peer
from tests.support.runs import named
from tests.unit.protocols import factories


@pytest.fixture
def trainer_relay():
    """A trainer's relay serving versions 1 and 2 of a full-mode run (many small chunks) on its
    own DHT peer; yields a function that starts it in the running loop."""
    from protocols.transport.dht import SwarmDHT

    dht = SwarmDHT.start("127.0.0.1", 0)
    key = generate_key()
    base = {"w": np.arange(4096, dtype=np.float32)}
    publisher = Publisher("run-1", key, "full", base, "topk-int8", 0.25, snapshot_every=100, chunk_size=512)
    published = [publisher.publish(v, {"w": base["w"] + v})[0] for v in (1, 2)]
    manifest = factories.manifest(run_key=public_bytes(key), update="full")

    async def start() -> tuple[str, str]:
        relay = Relay(keep_versions=10)
        for update, store in published:
            relay.remember(update, store)
        endpoint = await dht.endpoint()
        await relay.serve(endpoint)
        return endpoint.peer_id, next(a for a in dht.addresses() if "/ip4/127.0.0.1/" in a)

    yield start, manifest, published
    dht.shutdown()


async def silent_provider(address: str) -> tuple[Peer, list[int]]:
    """A peer that announces every version (the test names it first) and, asked for chunks,
    takes the request and sends nothing, ever."""
    peer = await Peer.start(address)
    asked: list[int] = []

    async def stall(info, reader, writer):
        asked.append(1)
        await reader.read(8)
        await asyncio.sleep(3600)

    await peer.p2p.add_binary_stream_handler(rpc.CHUNKS.name, stall)
    return peer, asked


def test_a_silent_provider_holds_a_catch_up_for_the_stall_watchdog_not_the_call_timeout(trainer_relay):
    """The node's catch-up with its own timeouts (60 s a call): the silent provider, asked
    first, costs it the 10 s no-chunk watchdog, after which its share comes from the trainer."""
    start, manifest, _ = trainer_relay

    async def go():
        trainer, address = await start()
        liar, asked = await silent_provider(address)
        node = await Peer.start(address)
        applied = []

        async def apply(update, store, payloads):
            applied.append(update.to_version)

        try:
            began = time.monotonic()
            try:
                async with asyncio.timeout(25):  # the call timeout is 60 s: its share must not wait for it
                    await updates.catch_up(node.endpoint, trainer, named(liar.peer_id), manifest, 0, 1,
                                           apply, CALL_TIMEOUT)
            except TimeoutError:
                raise AssertionError("the catch-up waited on the silent provider for 25 s") from None
            return time.monotonic() - began, applied, asked
        finally:
            await asyncio.gather(liar.shutdown(), node.shutdown())

    seconds, applied, asked = asyncio.run(go())
    assert applied == [1] and asked == [1]
    assert seconds < updates.STALL_SECONDS + 8, seconds


def test_a_provider_that_never_answers_costs_one_stall_and_is_then_skipped(trainer_relay):
    """Moved from tests/integration/test_delivery.py. One that takes the request and sends
    nothing held the whole fetch round until the call's timeout. Now its share goes elsewhere
    after `stall` seconds, and the node remembers it (`Shunned`): the next fetch does not ask it."""
    start, _, published = trainer_relay
    update, store = published[0]
    digests = list(store)

    async def go():
        trainer, address = await start()
        liar, asked = await silent_provider(address)
        node, shunned = await Peer.start(address), updates.Shunned()
        try:
            fetch = updates.fetch_chunks(node.endpoint, [liar.peer_id], trainer, digests, timeout=60, shunned=shunned,
                                         stall=1.0)
            assert set(await asyncio.wait_for(fetch, 20)) == set(digests)  # not the 60 s call timeout
            # Asked once; on a loaded machine the 1 s stall may run out before the request reaches it.
            first = list(asked)
            assert first in ([], [1]) and shunned.filter([liar.peer_id]) == []
            again = await updates.fetch_chunks(node.endpoint, [liar.peer_id], trainer, digests, timeout=60,
                                               shunned=shunned, stall=1.0)
            assert set(again) == set(digests) and asked == first  # not asked again
        finally:
            await asyncio.gather(liar.shutdown(), node.shutdown())

    asyncio.run(go())


async def trickling_provider(address: str) -> Peer:
    """A claimant that answers a chunk request with a chunk nobody asked for every 0.2 s, for
    ever: each one used to push the no-chunk watchdog back, holding its share for the whole call
    timeout (issue 55 point 2)."""
    import hashlib
    import os

    from protocols.messages import Chunk

    peer = await Peer.start(address)

    async def trickle(request, asker):
        while True:
            data = os.urandom(16)
            yield Chunk(hashlib.sha256(data).hexdigest(), data)  # valid, and wanted by nobody
            await asyncio.sleep(0.2)

    await peer.endpoint.serve(rpc.CHUNKS, trickle)
    return peer


def test_a_trickling_claimant_costs_one_stall_and_busy_does_not_forgive_it(trainer_relay):
    """Only a wanted chunk that verifies pushes the stall watchdog back, so a claimant sending
    chunks nobody asked for is given up on after one stall (its share comes from the trainer,
    asked in the same round), and a "busy" from the trainer forgives peers whose stream broke,
    not one that sat on its share."""
    start, _, published = trainer_relay
    update, store = published[0]
    digests = list(store)

    async def go():
        trainer, address = await start()
        liar = await trickling_provider(address)
        node, shunned = await Peer.start(address), updates.Shunned()
        try:
            fetch = updates.fetch_chunks(node.endpoint, [liar.peer_id], trainer, digests, timeout=60, shunned=shunned,
                                         stall=1.0)
            assert set(await asyncio.wait_for(fetch, 20)) == set(digests)  # not the 60 s call timeout
            assert shunned.filter([liar.peer_id]) == []
            shunned.forgive()  # what a node does when the trainer answers "busy"
            assert shunned.filter([liar.peer_id]) == []  # still shunned: it lied, its stream did not break
        finally:
            await asyncio.gather(liar.shutdown(), node.shutdown())

    asyncio.run(go())


def test_a_coordinator_whose_single_reply_never_ends_is_refused_at_the_second_frame():
    """A hostile coordinator answers the node's request for the base model's chunk list with the
    valid signed list, then the same again, without end. The node's fetch (its own 60 s
    timeout) stops reading at the second frame: it neither waits out the timeout nor buffers
    what the coordinator sends meanwhile."""
    from protocols.transport.dht import SwarmDHT

    key = generate_key()
    run = factories.manifest(run_key=public_bytes(key))
    listed = sign_message(factories.model_file(sha256=run.base_sha256), key).to_wire()
    dht = SwarmDHT.start("127.0.0.1", 0)

    async def go():
        server: Endpoint = await dht.endpoint()
        sent = []

        async def endless(request: bytes, peer: str):
            while True:
                sent.append(1)
                yield listed

        await server.serve(rpc.BASE, endless)
        node = await Peer.start(next(a for a in dht.addresses() if "/ip4/127.0.0.1/" in a))
        try:
            began = time.monotonic()
            try:
                async with asyncio.timeout(10):
                    with pytest.raises(TransportError, match="more than 1 replies"):
                        await fetch_model_file(node.endpoint, server.peer_id, run, CALL_TIMEOUT)
            except TimeoutError:
                raise AssertionError(f"the node read {len(sent)} frames of one reply for 10 s and went on") from None
            return time.monotonic() - began, node.endpoint.errors[rpc.BASE.name, "too_many_replies"], len(sent)
        finally:
            await node.shutdown()

    try:
        seconds, refused, sent = asyncio.run(go())
    finally:
        dht.shutdown()
    # idempotent: the node asks twice when a stream breaks, and refuses each at its second frame
    assert refused in (1, 2) and seconds < 5, (refused, seconds)
    print(f"the hostile coordinator got {sent} frames out")

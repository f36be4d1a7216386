"""Real hivemind DHTs and libp2p streams on 127.0.0.1."""

import asyncio
import os

import pytest

from protocols.errors import InvalidValue, RemoteError, TransportError
from protocols.transport.dht import SwarmDHT


@pytest.fixture(scope="module")
def swarm():
    boot = SwarmDHT.start("127.0.0.1", 0)
    joiner = SwarmDHT.start("127.0.0.1", 0, initial_peers=boot.addresses())
    yield boot, joiner
    joiner.shutdown()
    boot.shutdown()


def test_records_round_trip_with_subkeys(swarm):
    boot, joiner = swarm

    async def go():
        assert await boot.put("echo/fp/manifest", b"signed bytes", ttl=60)
        assert await boot.put("echo/fp/peers", b"alice", ttl=60, subkey="a")
        assert await joiner.put("echo/fp/peers", b"bob", ttl=60, subkey="b")
        assert await joiner.get("echo/fp/manifest") == b"signed bytes"
        assert await joiner.get("echo/fp/peers") == {"a": b"alice", "b": b"bob"}
        assert await joiner.get("echo/fp/absent") is None
        with pytest.raises(ValueError, match="exceeds"):
            await boot.put("echo/fp/big", b"x" * (65 * 1024), ttl=60)

    asyncio.run(go())


def test_streams_carry_large_payloads_errors_and_timeouts(swarm):
    boot, joiner = swarm

    async def go():
        server, client = await boot.endpoint(), await joiner.endpoint()

        async def echo(request: bytes, peer: str):
            assert peer == client.peer_id
            for i in range(0, len(request), 4 * 2**20):
                yield request[i : i + 4 * 2**20]

        async def refuse(request: bytes, peer: str):
            raise InvalidValue("no thanks")
            yield b""  # makes this an async generator

        async def slow(request: bytes, peer: str):
            await asyncio.sleep(30)
            yield b""

        await server.serve("t.echo", echo, max_request_bytes=32 * 2**20, timeout=30)
        await server.serve("t.refuse", refuse, max_request_bytes=1024, timeout=5)
        await server.serve("t.slow", slow, max_request_bytes=1024, timeout=60)
        payload = os.urandom(20 * 2**20)
        replies = await client.call(server.peer_id, "t.echo", payload, timeout=30, max_reply_bytes=4 * 2**20)
        assert b"".join(replies) == payload and len(replies) == 5

        with pytest.raises(RemoteError) as e:
            await client.call(server.peer_id, "t.refuse", b"x", timeout=10, max_reply_bytes=1024)
        assert e.value.code == "invalid_value" and "no thanks" in str(e.value) and server.peer_id[-8:] in str(e.value)

        # An oversize request is refused before it is read. The error frame usually arrives, but
        # the server closes the stream while our request is still in flight, which can reset it
        # first: either way the caller gets a typed error and the server counts the refusal.
        with pytest.raises((RemoteError, TransportError)):
            await client.call(server.peer_id, "t.refuse", b"y" * 4096, timeout=10, max_reply_bytes=1024)
        assert server.errors["t.refuse", "too_large"] == 1

        with pytest.raises(TransportError, match="within 1 s"):
            await client.call(server.peer_id, "t.slow", b"x", timeout=1, max_reply_bytes=1024)
        with pytest.raises(TransportError):
            await client.call(server.peer_id, "t.nobody_serves_this", b"x", timeout=10, max_reply_bytes=1024)
        with pytest.raises(TransportError, match="expected one reply"):
            await client.call_one(server.peer_id, "t.echo", b"", timeout=10, max_reply_bytes=1024)
        # The server keeps serving after all of that.
        assert await client.call_one(server.peer_id, "t.echo", b"still here", timeout=10, max_reply_bytes=1024) == b"still here"

    asyncio.run(go())

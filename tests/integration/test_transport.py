"""Real hivemind DHTs and libp2p streams on 127.0.0.1."""

import asyncio
import os

import pytest

from protocols.errors import InvalidValue, MalformedMessage, RemoteError, TransportError
from protocols.messages import Holders, HoldersRequest, RolloutBatch
from protocols.rpc import Rpc
from protocols.transport.dht import SwarmDHT
from protocols.wire import pack
from tests.unit.protocols import factories


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


class Reply:
    MAX_BYTES = 4 * 2**20  # what these test handlers may answer per frame


# Raw requests and replies (types without `from_wire`): what the transport does, whatever the bytes.
ECHO = Rpc("t.echo", bytes, (Reply,), 32 * 2**20, 30.0, per_peer=4, max_replies=8)
ENDLESS = Rpc("t.endless", bytes, (Reply,), 1024, 30.0, per_peer=4)  # one reply, by declaration
REFUSE = Rpc("t.refuse", bytes, (Reply,), 1024, 5.0, per_peer=4)
SLOW = Rpc("t.slow", bytes, (Reply,), 1024, 60.0, per_peer=1)


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

        entered = asyncio.Event()

        async def slow(request: bytes, peer: str):
            entered.set()
            await asyncio.sleep(30)
            yield b""

        async def endless(request: bytes, peer: str):
            while True:
                yield b"more"

        await server.serve(ECHO, echo)
        await server.serve(ENDLESS, endless)
        await server.serve(REFUSE, refuse)
        await server.serve(SLOW, slow)
        payload = os.urandom(20 * 2**20)
        replies = await client.call(server.peer_id, ECHO, payload)
        assert b"".join(replies) == payload and len(replies) == 5

        with pytest.raises(RemoteError) as e:
            await client.call(server.peer_id, REFUSE, b"x")
        assert e.value.code == "invalid_value" and "no thanks" in str(e.value) and server.peer_id[-8:] in str(e.value)

        # An oversize request is refused before it is read. The error frame usually arrives, but
        # the server closes the stream while our request is still in flight, which can reset it
        # first: either way the caller gets a typed error and the server counts the refusal.
        with pytest.raises((RemoteError, TransportError)):
            await client.call(server.peer_id, REFUSE, b"y" * 4096)
        assert server.errors["t.refuse", "too_large"] == 1

        # One peer may hold SLOW.per_peer calls at once; the next is refused before it is read.
        first = asyncio.create_task(client.call(server.peer_id, SLOW, b"x", timeout=5))
        await entered.wait()
        with pytest.raises(RemoteError) as e:
            await client.call(server.peer_id, SLOW, b"x", timeout=3)
        assert e.value.code == "busy" and server.errors["t.slow", "busy"] == 1
        # The first call ends by its timeout; once, on a loaded machine, its stream broke first
        # (IncompleteReadError): a typed TransportError either way, never a hang or a reply.
        with pytest.raises(TransportError, match="within 5 s|stream broke"):
            await first
        with pytest.raises(TransportError):
            await client.call(server.peer_id, Rpc("t.nobody_serves_this", None, (Reply,), 1024, 10.0, 1), b"x")
        # (idempotent: a fresh loopback stream that resets before its first frame is retried once,
        # as nodes' reads are; once, on a loaded machine, it broke here before the empty answer)
        with pytest.raises(TransportError, match="expected one reply"):
            await client.call_one(server.peer_id, ECHO, b"", idempotent=True)
        # A reply that never ends: the caller stops reading at the declared count.
        with pytest.raises(TransportError, match="more than 1 replies"):
            await client.call_one(server.peer_id, ENDLESS, b"")
        assert client.errors["t.endless", "too_many_replies"] == 1
        # A peer id that is no libp2p id (one an announcement might carry): a typed error, not
        # hivemind's ValueError out of the caller (issue 36 point 1).
        for bad in ("Qm-not-base58", "1" * 46):
            with pytest.raises(TransportError, match="not a libp2p peer id"):
                await client.call_one(bad, ECHO, b"x")
        # The server keeps serving after all of that.
        assert await client.call_one(server.peer_id, ECHO, b"still here", idempotent=True) == b"still here"

    asyncio.run(go())


def test_a_node_that_cannot_reach_the_coordinator_says_so_keeps_trying_and_stops_on_request(tmp_path, monkeypatch,
                                                                                            capsys):
    """The join address of a coordinator that is not up (yet, or any more): the node retries
    joining the DHT with backoff, says so on its console, and Ctrl-C still ends it at once."""
    from echo_node import session as session_module
    from echo_node.config import NodeConfig
    from echo_node.presence import Presence
    from echo_node.session import Session

    gone = SwarmDHT.start("127.0.0.1", 0)
    address = gone.addresses()[0]
    gone.shutdown()
    monkeypatch.setattr(session_module, "UNREACHABLE_SAY", 1.0)
    session = Session(NodeConfig(address=address, run_key="a" * 26, model=tmp_path / "unused.gguf",
                                 data_dir=tmp_path / "n"))
    presence = Presence(session)

    async def go():
        joining = asyncio.create_task(presence.join())
        said = ""
        async with asyncio.timeout(120):  # each try starts a DHT daemon: seconds on a loaded machine
            while "cannot reach the coordinator at" not in said:
                said += capsys.readouterr().out
                await asyncio.sleep(0.1)
        assert not joining.done()  # still trying
        session.request_stop()
        return await asyncio.wait_for(joining, 10)

    assert asyncio.run(go()) is False


TYPED = Rpc("t.typed", HoldersRequest, (Holders,), 256, 10.0, per_peer=4)
LIAR = Rpc("t.liar", HoldersRequest, (Holders,), 256, 10.0, per_peer=4)


def test_requests_and_replies_are_decoded_as_their_rpc_declares():
    """A handler gets the declared request decoded, and a request that is none is refused with
    its code before the handler runs; a caller gets declared replies decoded, and a reply that is
    none raises its ProtocolError (a hostile server cannot hand the caller anything else)."""
    async def go():  # a swarm of its own: the first stream after another test's aborted ones can reset
        server, client = await boot.endpoint(), await joiner.endpoint()
        seen = []

        async def typed(request: HoldersRequest, peer: str):
            seen.append(request)
            yield Holders((peer,))

        async def liar(request: HoldersRequest, peer: str):
            yield b"\x00 not a message"

        await server.serve(TYPED, typed)
        await server.serve(LIAR, liar)
        reply = await client.call_one(server.peer_id, TYPED, HoldersRequest(7))
        assert reply == Holders((client.peer_id,)) and seen == [HoldersRequest(7)]
        with pytest.raises(RemoteError) as e:
            await client.call_one(server.peer_id, TYPED, b"\x00 junk")
        assert e.value.code == "malformed" and len(seen) == 1
        with pytest.raises(MalformedMessage):
            await client.call_one(server.peer_id, LIAR, HoldersRequest(1))

    boot = SwarmDHT.start("127.0.0.1", 0)
    joiner = SwarmDHT.start("127.0.0.1", 0, initial_peers=boot.addresses())
    try:
        asyncio.run(go())
    finally:
        joiner.shutdown()
        boot.shutdown()


PUSH_LIKE = Rpc("t.push", bytes, (Reply,), 64 * 1024, 10.0, per_peer=4)


def test_a_deeply_nested_push_is_refused_as_malformed_not_a_traceback(caplog):
    """1,000 nested lists fit in 1 KB; walking them for the signature check once raised
    RecursionError, which the stream handler logged as a 134 KB traceback (issue 36 point 8)."""
    nested: list = []
    for _ in range(1000):
        nested = [nested]
    body = factories.batch().to_dict()
    data = pack(RolloutBatch.KIND, {**body, "padding": nested, "signature": b"s" * 64})
    assert len(data) < 2048

    async def go():
        server, client = await boot.endpoint(), await joiner.endpoint()  # a swarm of its own: no other test's streams

        async def push(request: bytes, peer: str):
            RolloutBatch.signed_body(request)
            yield b"accepted"

        await server.serve(PUSH_LIKE, push)
        with pytest.raises(RemoteError) as e:
            await client.call(server.peer_id, PUSH_LIKE, data)
        assert e.value.code == "malformed" and "nest containers 16 deep" in str(e.value)
        assert server.errors["t.push", "malformed"] == 1 and server.errors["t.push", "internal"] == 0

    boot = SwarmDHT.start("127.0.0.1", 0)
    joiner = SwarmDHT.start("127.0.0.1", 0, initial_peers=boot.addresses())
    try:
        with caplog.at_level("INFO"):
            asyncio.run(go())
    finally:
        joiner.shutdown()
        boot.shutdown()
    assert "RecursionError" not in caplog.text and "handler failed" not in caplog.text


def test_a_flood_of_reachability_checks_is_told_busy_not_queued(swarm):
    """Issue 36 point 10: every `echo.reach` waited for the one probe lock, so a flood of asks
    (a relayed one starts a p2pd daemon each) queued honest nodes' checks until they timed out.
    Past MAX_WAITING checks the asker is told `busy` at once; the rest are answered."""
    from protocols.errors import PeerRefused
    from protocols.messages import ReachReply, ReachRequest
    from protocols.transport.reach import MAX_WAITING, Prober

    boot, _ = swarm

    async def go():
        prober = Prober("127.0.0.1", boot.addresses()[0])
        await prober.start()
        try:
            # Each asks to be dialled at a port nobody listens on: refused, not reachable.
            asks = [prober.answer(ReachRequest(port=9, relayed=False), factories.peer_id(f"N{i}"), "/ip4/127.0.0.1/tcp/40000")
                    for i in range(3 * MAX_WAITING)]
            return await asyncio.gather(*asks, return_exceptions=True), prober.probes
        finally:
            await prober.close()

    results, probes = asyncio.run(go())
    busy = [r for r in results if isinstance(r, PeerRefused)]
    assert len(busy) == 2 * MAX_WAITING and {r.code for r in busy} == {"busy"}
    answered = [r for r in results if isinstance(r, ReachReply)]
    assert len(answered) == MAX_WAITING == probes and not any(r.reachable for r in answered)


class SmallReply:
    MAX_BYTES = 64 * 1024


U_ECHO = Rpc("t.u_echo", bytes, (SmallReply,), 1024, 10.0, per_peer=4, unary=True)
U_SLOW = Rpc("t.u_slow", bytes, (SmallReply,), 1024, 60.0, per_peer=1, unary=True)
U_TYPED = Rpc("t.u_typed", HoldersRequest, (Holders,), 256, 10.0, per_peer=4, unary=True)
U_HOSTILE = Rpc("t.u_hostile", bytes, (SmallReply,), 1024, 10.0, per_peer=4, unary=True)


def test_unary_calls_carry_replies_errors_and_limits_and_older_callers_still_stream(swarm):
    """Small one-reply calls go over the daemon's persistent connection (`Rpc.unary`). Each bad
    input gets the typed error a stream gives it, counted; the server keeps serving; a caller of
    an older release (streams only) is served the same, and a server of one is called over
    streams; a hostile server's bytes are refused."""
    import dataclasses

    from protocols.errors import ProtocolError
    from protocols.transport.streams import unary_name

    boot, joiner = swarm

    async def go():
        server, client = await boot.endpoint(), await joiner.endpoint()
        entered = asyncio.Event()

        async def echo(request: bytes, peer: str):
            if request == b"refuse":
                raise InvalidValue("no thanks")
            if request == b"bug":
                raise KeyError("a bug")
            if request == b"twice":
                yield b"one"
            yield request + peer[-4:].encode()

        async def slow(request: bytes, peer: str):
            entered.set()
            await asyncio.sleep(30)
            yield b""

        async def typed(request: HoldersRequest, peer: str):
            yield Holders((peer,))

        await server.serve(U_ECHO, echo)
        await server.serve(U_SLOW, slow)
        await server.serve(U_TYPED, typed)
        assert await client.call_one(server.peer_id, U_ECHO, b"hi") == b"hi" + client.peer_id[-4:].encode()
        raw = await client.p2p._client.call_unary_handler(server.p2p.peer_id, unary_name(U_ECHO), b"hi")
        assert raw == b"\x00hi" + client.peer_id[-4:].encode()  # (a unary call it was: a status byte, the reply)
        older = dataclasses.replace(U_ECHO, unary=False)  # what a caller of an older release sends: a stream
        assert await client.call_one(server.peer_id, older, b"hi") == b"hi" + client.peer_id[-4:].encode()
        assert await client.call_one(server.peer_id, U_TYPED, HoldersRequest(3)) == Holders((client.peer_id,))
        # A server of an older release serves the handler as a stream only: called so, and so from then on.
        await server.serve(dataclasses.replace(U_ECHO, name="t.u_old", unary=False), echo)
        newer = dataclasses.replace(U_ECHO, name="t.u_old")
        for _ in range(2):
            assert await client.call_one(server.peer_id, newer, b"hi") == b"hi" + client.peer_id[-4:].encode()
        assert client.streams_only == {(server.peer_id, "t.u_old")}

        for request, code in ((b"refuse", "invalid_value"), (b"bug", "internal"), (b"twice", "internal"),
                              (b"x" * 4096, "too_large")):
            with pytest.raises(RemoteError) as e:
                await client.call_one(server.peer_id, U_ECHO, request)
            assert e.value.code == code, request[:8]
        assert server.errors["t.u_echo", "too_large"] == 1 and server.errors["t.u_echo", "internal"] == 2
        with pytest.raises(RemoteError) as e:
            await client.call_one(server.peer_id, U_TYPED, b"\x00 junk")
        assert e.value.code == "malformed"

        # One peer may hold U_SLOW.per_peer calls at once; the next is told busy; the first ends
        # by the caller's timeout, a typed TransportError.
        first = asyncio.create_task(client.call(server.peer_id, U_SLOW, b"x", timeout=3))
        await entered.wait()
        with pytest.raises(RemoteError) as e:
            await client.call(server.peer_id, U_SLOW, b"x", timeout=3)
        assert e.value.code == "busy" and server.errors["t.u_slow", "busy"] == 1
        with pytest.raises(TransportError, match="within 3 s"):
            await first
        # The server's side of the cancelled call is forgotten, not kept for ever (hivemind keeps
        # a call's task until it returns: a caller cancelling calls would grow that table).
        for _ in range(50):
            if not server.p2p._client.control._handler_tasks:
                break
            await asyncio.sleep(0.1)
        assert not server.p2p._client.control._handler_tasks and server.errors["t.u_slow", "disconnected"] == 1
        with pytest.raises(TransportError):  # nobody serves it
            await client.call_one(server.peer_id, dataclasses.replace(U_ECHO, name="t.u_nobody"), b"x")

        # A hostile server: a status byte that is none, a reply past the declared size, an error
        # that is no ErrorReply. Typed errors, never a crash or an undeclared reply.
        answers = iter([b"\x07 what", b"\x00" + b"y" * (SmallReply.MAX_BYTES + 1), b"\x01 junk"])

        async def hostile(data: bytes, peer) -> bytes:
            return next(answers)

        await server.p2p._client.add_unary_handler(unary_name(U_HOSTILE), hostile)
        for _ in range(3):
            with pytest.raises(ProtocolError):
                await client.call_one(server.peer_id, U_HOSTILE, b"x")
        # The server keeps serving after all of that.
        assert await client.call_one(server.peer_id, U_ECHO, b"still") == b"still" + client.peer_id[-4:].encode()

    asyncio.run(go())


def test_a_unary_declaration_must_be_small_and_one_reply():
    with pytest.raises(ValueError, match="one reply"):
        Rpc("t.big", bytes, (Reply,), 1024, 10.0, per_peer=1, unary=True)  # a 4 MiB reply: too large
    with pytest.raises(ValueError, match="one reply"):
        Rpc("t.many", bytes, (SmallReply,), 1024, 10.0, per_peer=1, max_replies=2, unary=True)

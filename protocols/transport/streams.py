"""Framed request/reply streams between peers, over hivemind's libp2p daemon.

A call opens a libp2p stream to a named handler, writes one request frame and reads reply
frames until an end frame. A frame is an 8-byte big-endian length, then a status byte
(OK / ERROR) and the payload; an ERROR payload is an ErrorReply and becomes a `RemoteError`
naming the peer and handler. Lengths are checked against the handler's limit *before* reading,
so a peer cannot make us buffer more than we agreed to. Streams (not unary calls) carry
everything: hivemind caps unary messages at 4 MiB.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError

from protocols.errors import MessageTooLarge, ProtocolError, RemoteError, TransportError
from protocols.messages import ErrorReply
from protocols.multiaddr import MAX_PEER_ID_CHARS, is_peer_id
from protocols.rpc import Rpc

log = logging.getLogger(__name__)

HEADER_BYTES = 8
REFUSE_LINGER = 2.0  # seconds a refused caller gets to read the reason and hang up
OK, ERROR, END = b"\x00", b"\x01", b"\x02"

# A handler gets the request payload and the caller's peer id (and, served `with_address`, the
# multiaddr its stream came from) and yields reply payloads.
Handler = Callable[..., AsyncIterator[bytes]]


async def write_frame(writer: asyncio.StreamWriter, status: bytes, payload: bytes = b"") -> None:
    writer.write((len(payload) + 1).to_bytes(HEADER_BYTES, "big") + status)
    writer.write(payload)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bytes]:
    length = int.from_bytes(await reader.readexactly(HEADER_BYTES), "big")
    if length == 0 or length > max_bytes + 1:
        raise MessageTooLarge(f"frame of {length} bytes outside 1..{max_bytes + 1}")
    frame = await reader.readexactly(length)
    return frame[:1], frame[1:]


class Endpoint:
    """One process's side of the streams: serves handlers and calls other peers'."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        self.peer_id = p2p.peer_id.to_base58()
        self.errors: Counter[tuple[str, str]] = Counter()  # (handler, code) -> count, for metrics
        # Peers that cannot be dialled directly and the relay circuits they announced: dialled
        # through one of those before a stream is opened (`learn_relays`).
        self.relays: dict[str, tuple[str, ...]] = {}

    async def serve(self, rpc: Rpc, handler: Handler, with_address: bool = False) -> None:
        """Serve `rpc` with `handler`, within the declaration's request size, timeout and per-peer limit.
        `with_address`: the handler also gets the multiaddr the caller's stream came from."""
        name, max_request_bytes, timeout = rpc.name, rpc.max_request_bytes, rpc.timeout
        active: Counter[str] = Counter()  # peer -> calls in flight

        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            if active[peer] >= rpc.per_peer:
                self.errors[name, "busy"] += 1
                await self._refuse(reader, writer, ErrorReply("busy", f"{rpc.per_peer} {name} calls already in flight"),
                                   max_request_bytes)
                return
            active[peer] += 1
            try:
                # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation.
                async with asyncio.timeout(timeout):
                    status, request = await read_frame(reader, max_request_bytes)
                if status != OK:
                    raise ProtocolError(f"request frame has status {status!r}")
                replies = handler(request, peer, str(info.addr)) if with_address else handler(request, peer)
                async with asyncio.timeout(timeout):
                    async for reply in replies:
                        await write_frame(writer, OK, reply)
                    await write_frame(writer, END)
            except ProtocolError as e:
                self.errors[name, e.code] += 1
                log.info("%s from %s refused: %s", name, peer[-8:], e)
                await self._refuse(reader, writer, ErrorReply(e.code, str(e)), max_request_bytes)
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as e:
                self.errors[name, "disconnected"] += 1
                log.info("%s from %s: stream ended early (%s)", name, peer[-8:], type(e).__name__)
            except Exception:  # a bug in a handler must not take the server down; the caller is told
                self.errors[name, "internal"] += 1
                log.exception("%s from %s: handler failed", name, peer[-8:])
                await self._try_send_error(writer, ErrorReply("internal", "internal error in handler"))
            finally:
                writer.close()
                active[peer] -= 1
                if not active[peer]:
                    del active[peer]

        await self.p2p.add_binary_stream_handler(name, on_stream)

    @classmethod
    async def _refuse(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: ErrorReply,
                      max_request_bytes: int) -> None:
        """Send the error, then give the caller a moment to read it and hang up before we close:
        closing at once can reset the stream while the caller's request is still arriving, and
        the caller would see a broken stream instead of the reason. What it still sends is read
        and dropped, at most one request's worth, for at most `REFUSE_LINGER` seconds."""
        await cls._try_send_error(writer, reply)
        try:
            async with asyncio.timeout(REFUSE_LINGER):
                budget = max_request_bytes + HEADER_BYTES + 1
                while budget > 0 and (chunk := await reader.read(min(budget, 65536))):
                    budget -= len(chunk)
        except (ConnectionError, TimeoutError):
            pass
        writer.close()

    @staticmethod
    async def _try_send_error(writer: asyncio.StreamWriter, reply: ErrorReply) -> None:
        try:
            async with asyncio.timeout(5.0):
                await write_frame(writer, ERROR, reply.to_wire())
        except (ConnectionError, TimeoutError):
            pass  # the caller is gone; nothing left to tell

    async def call(
        self, peer: str, rpc: Rpc, request: bytes, on_reply: Callable[[bytes], Awaitable[None] | None] | None = None,
        timeout: float | None = None,
    ) -> list[bytes]:
        """Send `request` to `rpc`'s handler on `peer`; return the reply payloads (or feed each to
        `on_reply` as it arrives, for long streams). The whole call is bounded by the declaration's
        timeout, or a shorter `timeout`."""
        name, max_reply_bytes = rpc.name, rpc.max_reply_bytes
        if not is_peer_id(peer):  # hivemind's PeerID raises ValueError out of the call for it
            raise TransportError(f"{name}: {peer[:MAX_PEER_ID_CHARS]!r} is not a libp2p peer id")
        timeout = rpc.timeout if timeout is None else min(timeout, rpc.timeout)
        replies: list[bytes] = []
        count = 0
        writer = None
        try:
            async with asyncio.timeout(timeout):
                if peer in self.relays:
                    await self._dial_relayed(peer)
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), name)
                await write_frame(writer, OK, request)
                while True:
                    status, payload = await read_frame(reader, max_reply_bytes)
                    if status == END:
                        return replies
                    if status == ERROR:
                        reply = ErrorReply.from_wire(payload)
                        raise RemoteError(reply.code, reply.message, peer, name)
                    count += 1
                    if count > rpc.max_replies:  # a peer may not make us read without end: as a broken stream
                        self.errors[name, "too_many_replies"] += 1
                        raise TransportError(f"{name} on peer {peer[-8:]}: more than {rpc.max_replies} replies")
                    if on_reply is None:
                        replies.append(payload)
                    elif (pending := on_reply(payload)) is not None:
                        await pending
        except TimeoutError:
            raise TransportError(f"{name} on peer {peer[-8:]}: no complete reply within {timeout:.0f} s") from None
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise TransportError(f"{name} on peer {peer[-8:]}: stream broke ({type(e).__name__})") from None
        except (P2PDaemonError, P2PHandlerError) as e:
            # p2pd's answer for an unreachable peer or a handler name nobody serves.
            raise TransportError(f"{name} on peer {peer[-8:]}: {e}") from None
        finally:
            if writer is not None:
                writer.close()

    def learn_relays(self, announcements, relay: str) -> None:
        """Remember how to reach announced peers that are only reachable through a relay: through
        the run's one relay (the coordinator at `relay`), never an address a peer picks (it would
        make every node dial wherever a signed announcement says)."""
        ours = f"{relay}/p2p-circuit"
        self.relays = {a.peer_id: (ours,) for a in announcements if ours in a.relay_addrs and a.peer_id != self.peer_id}

    async def _dial_relayed(self, peer: str) -> None:
        """Connect to a relayed peer through a circuit it announced (a no-op once connected);
        if none works, the stream open that follows reports the failure."""
        from protocols.transport.reach import circuit

        for address in self.relays.get(peer, ()):
            try:
                await self.p2p._client.connect(PeerID.from_base58(peer), [circuit(address)])
                return
            except (P2PDaemonError, ValueError) as e:
                log.info("relay circuit %s to %s failed: %s", address, peer[-8:], e)

    async def call_one(self, peer: str, rpc: Rpc, request: bytes, idempotent: bool = False,
                       timeout: float | None = None) -> bytes:
        """One reply. `idempotent` requests (reads) are retried once if the stream breaks: a fresh
        libp2p stream occasionally resets before its first frame (seen on loopback)."""
        try:
            replies = await self.call(peer, rpc, request, timeout=timeout)
        except TransportError as e:
            if not idempotent or isinstance(e, RemoteError):
                raise
            log.info("%s on %s: %s; retrying once", rpc.name, peer[-8:], e)
            replies = await self.call(peer, rpc, request, timeout=timeout)
        if len(replies) != 1:
            raise TransportError(f"{rpc.name} on peer {peer[-8:]}: expected one reply, got {len(replies)}")
        return replies[0]

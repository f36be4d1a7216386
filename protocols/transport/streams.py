"""Framed request/reply streams between peers, over hivemind's libp2p daemon.

A call opens a libp2p stream to a named handler, writes one request frame and reads reply
frames until an end frame. A frame is an 8-byte big-endian length, then a status byte
(OK / ERROR) and the payload; an ERROR payload is an ErrorReply and becomes a `RemoteError`
naming the peer and handler. Lengths are checked against the handler's limit *before* reading,
so a peer cannot make us buffer more than we agreed to.

Small one-reply calls (`Rpc.unary`: a lease, a holders ask) go over the daemon's persistent
connection instead, as libp2p "unary" calls: the request whole, then one status byte and the
reply. A stream costs a new connection to the daemon at each end; a unary call reuses one, at
40 % of the CPU (`bench/unary_calls.py`). The daemon reads a unary request whole (at most
4 MiB) before we can check its length: the price of a bad one is that much, not a header's.
Everything else, and callers of older releases, use streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError

from protocols.errors import MessageTooLarge, ProtocolError, RemoteError, TransportError
from protocols.messages import ErrorReply
from protocols.multiaddr import MAX_PEER_ID_CHARS, is_peer_id
from protocols.rpc import Rpc, encode

log = logging.getLogger(__name__)

HEADER_BYTES = 8
REFUSE_LINGER = 2.0  # seconds a refused caller gets to read the reason and hang up
MAX_REMEMBERED = 1024  # entries of each per-peer table: relayed peers (`learn_relays`), callers dialled back, stream-only handlers
DIAL_BACK_SECONDS = 600.0  # a caller that reached us through a relay is dialled back at most this often
NOT_SERVED = "protocols not supported"  # p2pd's error for a unary call to a protocol the peer does not serve
OK, ERROR, END = b"\x00", b"\x01", b"\x02"

# A handler gets the request (decoded as its Rpc declares: `Rpc.decode_request`) and the caller's
# peer id (and, served `with_address`, the multiaddr its stream came from) and yields replies.
Handler = Callable[..., AsyncIterator[Any]]


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


def unary_name(rpc: Rpc) -> str:
    """The protocol a unary call (`Rpc.unary`) goes to: the stream's name stays for older callers."""
    return f"{rpc.name}/unary"


class Endpoint:
    """One process's side of the streams: serves handlers and calls other peers'."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        self.peer_id = p2p.peer_id.to_base58()
        self.errors: Counter[tuple[str, str]] = Counter()  # (handler, code) -> count, for metrics
        # Peers that cannot be dialled directly, and the relay circuit they are dialled through
        # before a stream is opened (`learn_relays`).
        self.relays: dict[str, tuple[str, ...]] = {}
        # (peer, handler) a peer serves as a stream only (an older release): called so from now on.
        self.streams_only: set[tuple[str, str]] = set()
        # Callers that reached us through a relay circuit, and when we dialled them back (`_dial_back`).
        self.dialled_back: dict[str, float] = {}
        self._background: set[asyncio.Task] = set()  # dial-backs in flight (kept referenced)

    async def serve(self, rpc: Rpc, handler: Handler, with_address: bool = False) -> None:
        """Serve `rpc` with `handler`, within the declaration's request size, timeout and per-peer limit.
        `with_address`: the handler also gets the multiaddr the caller's stream came from."""
        name, max_request_bytes, timeout = rpc.name, rpc.max_request_bytes, rpc.timeout
        active: Counter[str] = Counter()  # peer -> calls in flight

        busy = ErrorReply("busy", f"{rpc.per_peer} {name} calls already in flight")  # (both ways of calling)

        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            if "/p2p-circuit" in str(info.addr):
                self._dial_back(info.peer_id)
            if active[peer] >= rpc.per_peer:
                self.errors[name, "busy"] += 1
                await self._refuse(reader, writer, busy, max_request_bytes)
                return
            active[peer] += 1
            try:
                # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation.
                async with asyncio.timeout(timeout):
                    status, payload = await read_frame(reader, max_request_bytes)
                if status != OK:
                    raise ProtocolError(f"request frame has status {status!r}")
                request = rpc.decode_request(payload)
                replies = handler(request, peer, str(info.addr)) if with_address else handler(request, peer)
                async with asyncio.timeout(timeout):
                    async for reply in replies:
                        await write_frame(writer, OK, encode(reply))
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
        if not rpc.unary:
            return

        async def on_unary(data: bytes, remote: PeerID) -> bytes:
            """The same call over the daemon's persistent connection: the request whole, one
            status byte and the reply (or an ErrorReply) back. Never raises: hivemind would send
            the exception's repr."""
            peer = remote.to_base58()
            if active[peer] >= rpc.per_peer:
                self.errors[name, "busy"] += 1
                return ERROR + busy.to_wire()
            active[peer] += 1
            try:
                if len(data) > max_request_bytes:  # (the daemon read at most UNARY_MAX_BYTES)
                    raise MessageTooLarge(f"request of {len(data)} bytes exceeds {max_request_bytes}")
                request = rpc.decode_request(data)
                async with asyncio.timeout(timeout):
                    replies = [encode(reply) async for reply in handler(request, peer)]
                if len(replies) != 1:
                    raise RuntimeError(f"{len(replies)} replies to a unary call")
                return OK + replies[0]
            except ProtocolError as e:
                self.errors[name, e.code] += 1
                log.info("%s from %s refused: %s", name, peer[-8:], e)
                return ERROR + ErrorReply(e.code, str(e)).to_wire()
            except TimeoutError:  # the caller's own timeout is the same: it has given up by now
                self.errors[name, "disconnected"] += 1
                return ERROR + ErrorReply("timeout", f"no reply within {timeout:.0f} s").to_wire()
            except asyncio.CancelledError:
                # The caller cancelled (hivemind cancels this task for it). Answered, not raised:
                # hivemind forgets a call's task only when it returns, so each cancelled call
                # would stay in its table, a few hundred bytes a caller could add without end.
                self.errors[name, "disconnected"] += 1
                return ERROR + ErrorReply("cancelled", "the caller cancelled").to_wire()
            except Exception:  # a bug in a handler must not take the server down; the caller is told
                self.errors[name, "internal"] += 1
                log.exception("%s from %s: handler failed", name, peer[-8:])
                return ERROR + ErrorReply("internal", "internal error in handler").to_wire()
            finally:
                active[peer] -= 1
                if not active[peer]:
                    del active[peer]

        await self.p2p._client.add_unary_handler(unary_name(rpc), on_unary)

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
        self, peer: str, rpc: Rpc, request=None, on_reply: Callable[[Any], Awaitable[None] | None] | None = None,
        timeout: float | None = None,
    ) -> list:
        """Send `request` (a message, or None for an empty request) to `rpc`'s handler on `peer`;
        return the replies, decoded as `rpc` declares (or feed each to `on_reply` as it arrives,
        for long streams). A reply that is no declared message raises its ProtocolError. The
        whole call is bounded by the declaration's timeout, or a shorter `timeout`."""
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
                if rpc.unary and (peer, name) not in self.streams_only:
                    raw = await self._call_unary(peer, rpc, encode(request))
                    if raw is not None:
                        reply = self._unary_reply(peer, rpc, raw)
                        if on_reply is not None and (pending := on_reply(reply)) is not None:
                            await pending
                        return [] if on_reply is not None else [reply]
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), name)
                await write_frame(writer, OK, encode(request))
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
                    reply = rpc.decode_reply(payload)
                    if on_reply is None:
                        replies.append(reply)
                    elif (pending := on_reply(reply)) is not None:
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

    async def _call_unary(self, peer: str, rpc: Rpc, request: bytes) -> bytes | None:
        """The peer's raw answer to a unary call; None if it serves no such unary call (an older
        release: it is called over a stream, now and from now on)."""
        try:
            return await self.p2p._client.call_unary_handler(PeerID.from_base58(peer), unary_name(rpc), request)
        except P2PDaemonError as e:
            if NOT_SERVED not in str(e):
                raise
        if len(self.streams_only) >= MAX_REMEMBERED:
            self.streams_only = set()
        self.streams_only.add((peer, rpc.name))
        return None

    @staticmethod
    def _unary_reply(peer: str, rpc: Rpc, raw: bytes):
        """A unary call's answer (`serve`'s `on_unary`): its reply, decoded as `rpc` declares, or
        the handler's ErrorReply raised as a RemoteError."""
        status, payload = raw[:1], raw[1:]
        if status == ERROR:
            reply = ErrorReply.from_wire(payload)
            raise RemoteError(reply.code, reply.message, peer, rpc.name)
        if status != OK:
            raise ProtocolError(f"{rpc.name} on peer {peer[-8:]}: a reply with status {status!r}")
        if len(payload) > rpc.max_reply_bytes:
            raise MessageTooLarge(f"{rpc.name} on peer {peer[-8:]}: a reply of {len(payload)} bytes")
        return rpc.decode_reply(payload)

    def learn_relays(self, peers, relay: str) -> None:
        """Reach `peers` (behind NAT, as the coordinator at `relay` found) through its relay
        circuit: the run's one relay, never an address a peer picks. Bounded: a long run meets
        new peers for ever."""
        if len(self.relays) > MAX_REMEMBERED:
            self.relays = {}
        self.relays.update({peer: (f"{relay}/p2p-circuit",) for peer in peers if peer != self.peer_id})

    def _dial_back(self, peer: PeerID) -> None:
        """A caller reached us through a relay circuit: we are behind NAT. Dial it back directly
        (connection reversal: it cannot dial us, we can dial it), so that its next streams run
        over a direct connection. Bulk data through the coordinator's relay is reset after a
        few MB (measured: tests/integration/test_nat.py), and it would cost the coordinator's
        bandwidth. libp2p dials the addresses the caller's own peer announced, and the handshake
        checks the peer id: at most one dial a second, and one per caller per DIAL_BACK_SECONDS."""
        now, caller = time.monotonic(), peer.to_base58()
        if now - self.dialled_back.get(caller, -DIAL_BACK_SECONDS) < DIAL_BACK_SECONDS:
            return
        if self.dialled_back and now - max(self.dialled_back.values()) < 1.0:
            return
        if len(self.dialled_back) >= MAX_REMEMBERED:
            self.dialled_back = {}
        self.dialled_back[caller] = now

        async def dial() -> None:
            # libp2p's connect is a no-op while the relayed connection stands, so it goes first
            # (with the stream that came over it: the caller asks again, over the direct one).
            try:
                await self.p2p._client.disconnect(peer)
                await self.p2p._client.connect(peer, [])
            except P2PDaemonError as e:
                log.info("dialling %s back failed: %s", caller[-8:], e)

        task = asyncio.ensure_future(dial())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _dial_relayed(self, peer: str) -> None:
        """Connect to a relayed peer through its relay circuit, unless connected already;
        if none works, the stream open that follows reports the failure."""
        from protocols.transport.reach import circuit

        if any(p.peer_id.to_base58() == peer for p in await self.p2p._client.list_peers()):
            return  # it dialled us back (`_dial_back`), or the circuit is up: libp2p picks the direct one
        for address in self.relays.get(peer, ()):
            try:
                await self.p2p._client.connect(PeerID.from_base58(peer), [circuit(address)])
                return
            except (P2PDaemonError, ValueError) as e:
                log.info("relay circuit %s to %s failed: %s", address, peer[-8:], e)

    async def call_one(self, peer: str, rpc: Rpc, request=None, idempotent: bool = False,
                       timeout: float | None = None):
        """One reply, decoded (`call`). `idempotent` requests (reads) are retried once if the stream breaks: a fresh
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

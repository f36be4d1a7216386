"""Every handler a peer serves, declared once: the caller and the server both use these.

Each `Rpc` names its handler, its request and reply message types, the largest request the
server reads (checked before reading a stream; a unary call's daemon reads it whole first), the
longest it takes (server and caller alike), and how many calls one peer may have in flight at
once (the server refuses more with `busy`), how many reply frames a call takes (the caller
refuses more, so a reply is never endless), and whether it is a unary call. docs/protocols.md
lists them.

The types are what `Endpoint.serve` and `Endpoint.call` decode with: a handler gets the declared
request (None for an empty one) and yields declared replies; a caller sends a message and gets
declared replies back. A type without `from_wire` (`bytes`) travels as it is: a push's batch,
which the service decodes in stages (the signer first, so that a bad batch is charged to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.messages.updates import MAX_CHUNKS_PER_REQUEST
from protocols.messages import (
    Chunk, ChunkRequest, Holders, HoldersRequest, LeaseRequest, ModelFile, NoWork, PushReceipt, ReachReply, ReachRequest, RolloutBatch, RunManifest,
    TaskLease, UpdateIndex, UpdateRequest, WeightUpdate,
)
from protocols.wire import decode_one_of

# hivemind's daemons carry unary messages of up to 4 MiB, headers included; ours leave room for them.
UNARY_MAX_BYTES = 4 * 2**20 - 64 * 1024


@dataclass(frozen=True)
class Rpc:
    name: str
    request: type | None  # None: the request is empty
    replies: tuple[type, ...]  # one of these per reply frame
    max_request_bytes: int
    timeout: float  # seconds for the whole call, on both sides
    per_peer: int  # calls one peer may have in flight at once
    max_replies: int = 1  # reply frames in one call: the caller refuses more (more than 1: a stream)
    # Small and one reply: called over the daemon's persistent connection (a libp2p "unary" call)
    # rather than a stream of its own, and also served as a stream for callers of older releases.
    # A stream costs a new daemon connection at each end: 2.5x the CPU of a unary call
    # (bench/unary_calls.py; docs/protocols.md, "Unary calls").
    unary: bool = False

    def __post_init__(self):
        if self.unary and (self.max_replies != 1 or max(self.max_request_bytes, self.max_reply_bytes) > UNARY_MAX_BYTES):
            raise ValueError(f"{self.name}: a unary call carries one reply and at most {UNARY_MAX_BYTES} bytes each way")

    @property
    def max_reply_bytes(self) -> int:
        return max(reply.MAX_BYTES for reply in self.replies)

    def decode_request(self, payload: bytes):
        """The request as a handler gets it. ProtocolError if it is no valid declared message."""
        if self.request is None:
            return None
        return self.request.from_wire(payload) if hasattr(self.request, "from_wire") else payload

    def decode_reply(self, payload: bytes):
        """A reply frame as the caller gets it: one of the declared replies (ProtocolError if not)."""
        if not all(hasattr(reply, "from_wire") for reply in self.replies):
            return payload
        return decode_one_of(payload, self.replies)


def encode(message) -> bytes:
    """The wire bytes of a request or reply: a message's, b"" for None, bytes as they are."""
    if message is None:
        return b""
    return message if isinstance(message, bytes) else message.to_wire()


MANIFEST = Rpc("echo.manifest", None, (RunManifest,), 1024, 60.0, per_peer=4, unary=True)
LEASE = Rpc("echo.lease", LeaseRequest, (TaskLease, NoWork), LeaseRequest.MAX_BYTES, 60.0, per_peer=2, unary=True)
PUSH = Rpc("echo.push", bytes, (PushReceipt,), RolloutBatch.MAX_BYTES, 300.0, per_peer=2)
UPDATES = Rpc("echo.updates", None, (UpdateIndex,), 1024, 60.0, per_peer=4, unary=True)
UPDATE = Rpc("echo.update", UpdateRequest, (WeightUpdate,), UpdateRequest.MAX_BYTES, 60.0, per_peer=4)
BASE = Rpc("echo.base", None, (ModelFile,), 1024, 60.0, per_peer=4)
CHUNKS = Rpc("echo.chunks", ChunkRequest, (Chunk,), ChunkRequest.MAX_BYTES, 120.0, per_peer=4,
             max_replies=MAX_CHUNKS_PER_REQUEST)  # a chunk a digest asked for, at most
# Who holds a version: asked of the coordinator, once per version a node fetches (not polled).
HOLDERS = Rpc("echo.holders", HoldersRequest, (Holders,), HoldersRequest.MAX_BYTES, 30.0, per_peer=2, unary=True)
REACH = Rpc("echo.reach", ReachRequest, (ReachReply,), ReachRequest.MAX_BYTES, 20.0, per_peer=1)

ALL = (MANIFEST, LEASE, PUSH, UPDATES, UPDATE, BASE, CHUNKS, HOLDERS, REACH)

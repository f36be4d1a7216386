"""Typed errors for everything a peer can send us.

Every refusal of remote input raises a subclass of `ProtocolError`. Each class has a short
`code` that travels in an `ErrorReply` and names the counter a peer's misbehaviour is tallied
under, so callers can `except ProtocolError as e: counts[e.code] += 1` and keep serving.
"""

from __future__ import annotations


class EchoError(Exception):
    """Root of every error Echo swarm raises on purpose."""


class ConfigError(EchoError, ValueError):
    """A local setting (a config file, an option) is wrong; the message names it and how to fix it."""


class ProtocolError(EchoError):
    """Remote input was refused. `code` is stable and safe to send back to the peer."""

    code = "protocol"


class MalformedMessage(ProtocolError):
    """Not msgpack, not a map, a missing field or a field of the wrong type."""

    code = "malformed"


class UnsupportedVersion(ProtocolError):
    """The sender speaks a protocol version we do not."""

    code = "unsupported_version"


class MessageTooLarge(ProtocolError):
    """A byte or element limit was exceeded."""

    code = "too_large"


class InvalidValue(ProtocolError):
    """Well-formed but wrong: NaN logprobs, token ids outside the vocab, negative versions, ..."""

    code = "invalid_value"


class SignatureError(ProtocolError):
    """A signature is missing, does not verify, or comes from a key we do not trust."""

    code = "bad_signature"


class IntegrityError(ProtocolError):
    """Content does not match its sha256 (a chunk, a base model)."""

    code = "bad_hash"


class CodecError(ProtocolError):
    """A tensor update does not fit the tensor it claims to update (shape, dtype, encoding)."""

    code = "bad_delta"


class LeaseError(ProtocolError):
    """A lease is unknown, expired, already used or held by another node."""

    code = "bad_lease"


class Beaten(LeaseError):
    """Another key's shadow of this lease was answered first (`protocols.leases.LeaseBook.shadow`):
    the batch was still judged, and if it passed it counts as the key's proof of work, but the
    seeds are done and it is not trained on or credited."""

    code = "answered_first_by_another"


class TranscriptError(ProtocolError):
    """A rollout's transcript does not replay: its environment turns differ from what the
    environment says for the model's turns, or it breaks the turn rules."""

    code = "bad_transcript"


class Truncated(TranscriptError):
    """A model turn ends where sampling does not stop (neither at the end-of-turn token nor at the
    turn's token limit), or an episode stops while it could go on: the node cut what it sampled,
    e.g. right after the gold answer. A cheat, struck as a failed verification is."""

    code = "truncated"


class KeyFileError(EchoError):
    """A local key file is missing, malformed or readable by other users."""


class TransportError(EchoError):
    """A call to a peer failed in transit: unreachable, timed out, or the stream broke."""


class RemoteError(TransportError):
    """The peer's handler refused our request; `code` is its ProtocolError code."""

    def __init__(self, code: str, message: str, peer: str, handler: str):
        super().__init__(f"{handler} on peer {peer[-8:]} refused: [{code}] {message}")
        self.code, self.remote_message, self.peer, self.handler = code, message, peer, handler


class VerificationError(ProtocolError):
    """A rollout's tokens or behaviour logprobs are not what sampling with the claimed weights and
    the lease's noise gives: the node wrote them (`bad_sampling`) or misreported them (`bad_logprobs`)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class PeerRefused(ProtocolError):
    """The peer may not do this now: banned, not on the allow-list, too many requests or leases.
    `code` names which, so each is counted apart."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

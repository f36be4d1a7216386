"""Content-addressed chunking of tensor payloads for WeightUpdate delivery.

A payload is cut into `chunk_size` pieces, each named by its sha256; a receiver asks any provider
for a digest and accepts the bytes only if they hash to it, so a chunk can come from the trainer or
any peer without trusting either.
"""

from __future__ import annotations

from collections.abc import Callable

from protocols.errors import IntegrityError
from protocols.messages import TensorEntry
from protocols.signing import sha256_hex

DEFAULT_CHUNK_SIZE = 4 * 2**20


def split(payload: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[tuple[str, bytes]]:
    """(digest, bytes) pieces in order; an empty payload has no chunks."""
    pieces = [payload[i : i + chunk_size] for i in range(0, len(payload), chunk_size)]
    return [(sha256_hex(p), p) for p in pieces]


def check(digest: str, data: bytes) -> bytes:
    if sha256_hex(data) != digest:
        raise IntegrityError(f"chunk {digest[:12]}: content hashes to {sha256_hex(data)[:12]}")
    return data


def assemble(entry: TensorEntry, fetch: Callable[[str], bytes]) -> bytearray:
    """Rebuild one tensor's payload from verified chunks; `fetch(digest)` returns raw bytes. A new
    bytearray, which `delta.decode` may take over as a float32 tensor's memory."""
    payload = bytearray().join(check(d, fetch(d)) for d in entry.chunks)
    if len(payload) != entry.nbytes:
        raise IntegrityError(f"tensor {entry.name!r}: chunks hold {len(payload)} bytes, manifest says {entry.nbytes}")
    return payload

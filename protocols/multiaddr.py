"""The parts of libp2p multiaddrs this project reads (`/ip4/A/tcp/P/p2p/ID`), and libp2p peer ids,
as plain strings: no hivemind needed to read an address or to check an id a peer sent."""

from __future__ import annotations

_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
MAX_PEER_ID_CHARS = 64  # a sha256 multihash is 46 characters, an identity one (Ed25519 key) 52
_SHA256, _IDENTITY = 0x12, 0x00  # multihash codes a peer id may use (libp2p's peer-ids spec)
_MAX_IDENTITY_BYTES = 42  # keys up to this size are inlined in the id, bigger ones hashed


def is_peer_id(text: str) -> bool:
    """Is `text` a libp2p peer id in base58: a multihash that is a sha256 digest of the peer's key
    ("Qm...") or the key itself ("12D3KooW...")? What a peer sends as its id is checked so; a
    daemon asked to dial anything else fails, or its client raises out of the caller."""
    if not 0 < len(text) <= MAX_PEER_ID_CHARS:
        return False
    number = 0
    for char in text:
        digit = _BASE58.find(char)
        if digit < 0:
            return False
        number = number * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))  # base58 spells leading zero bytes as "1"
    raw = b"\0" * zeros + number.to_bytes((number.bit_length() + 7) // 8, "big")
    if len(raw) < 2 or raw[1] != len(raw) - 2:
        return False
    return (raw[0] == _SHA256 and raw[1] == 32) or (raw[0] == _IDENTITY and raw[1] <= _MAX_IDENTITY_BYTES)


def peer_of(address: str) -> str:
    """The libp2p peer id at the end of a multiaddr (`/ip4/.../tcp/N/p2p/<id>`)."""
    if "/p2p/" not in address:
        raise ValueError(f"{address!r} names no peer (no /p2p/ part)")
    peer = address.rsplit("/p2p/", 1)[1]
    if not is_peer_id(peer):
        raise ValueError(f"{address!r} does not end in a libp2p peer id")
    return peer


def tcp_port(address: str) -> int:
    """The TCP port of a multiaddr (`/ip4/.../tcp/N/...`)."""
    if "/tcp/" not in address:
        raise ValueError(f"{address!r} has no /tcp/ part")
    port = address.split("/tcp/", 1)[1].split("/", 1)[0]
    if not port.isdigit():
        raise ValueError(f"{address!r} has no TCP port number")
    return int(port)


def is_loopback(address: str) -> bool:
    return address.startswith(("/ip4/127.", "/ip6/::1/"))

"""The parts of libp2p multiaddrs this project reads (`/ip4/A/tcp/P/p2p/ID`), as plain strings:
no hivemind needed to read an address."""

from __future__ import annotations


def peer_of(address: str) -> str:
    """The libp2p peer id at the end of a multiaddr (`/ip4/.../tcp/N/p2p/<id>`)."""
    if "/p2p/" not in address:
        raise ValueError(f"{address!r} names no peer (no /p2p/ part)")
    return address.rsplit("/p2p/", 1)[1]


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

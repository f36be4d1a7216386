"""The swarm's DHT: small signed records that let peers find the run and each other.

Keys are namespaced by the run key's fingerprint (what a volunteer pins in its join command):
- `echo/<fp>/manifest`  the signed RunManifest
- `echo/<fp>/version`   the latest published version: a tiny msgpack map {version, time}
- `echo/<fp>/peers`     one subkey per peer (node fingerprint) holding its signed PeerAnnouncement

The DHT is open: anyone can write any key, so readers verify every record (signatures, the pinned
fingerprint) and treat it as a hint. Values stay small (a DHT value of 256 KiB killed the DHT
process in our measurements); tensors and batches travel over streams.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
from pathlib import Path

# hivemind reads these once at import; keep its and p2pd's logs to warnings unless asked.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
os.environ.setdefault("GOLOG_LOG_LEVEL", "error")

import hivemind  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from protocols.errors import TransportError  # noqa: E402
from protocols.transport.streams import Endpoint  # noqa: E402

# Every DHT call is pickled through a pipe to the DHT process; past ~15.6 KiB pickled that process
# can die and a caller waits forever (measured). Our records are a few hundred bytes.
MAX_RECORD_BYTES = 8 * 1024
PR_SET_PDEATHSIG = 1


async def _die_with_parent(_dht, _node) -> None:
    """Runs inside the DHT process: without this, a coordinator or node killed with SIGKILL leaves
    the DHT process and its p2pd daemon running forever, still holding the port and identity."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def peer_of(address: str) -> str:
    """The libp2p peer id at the end of a multiaddr (`/ip4/.../tcp/N/p2p/<id>`)."""
    if "/p2p/" not in address:
        raise ValueError(f"{address!r} names no peer (no /p2p/ part)")
    return address.rsplit("/p2p/", 1)[1]


def record_key(fingerprint: str, name: str) -> str:
    return f"echo/{fingerprint}/{name}"


class SwarmDHT:
    """A hivemind DHT (its own process plus the p2pd daemon) with Echo's records on top."""

    def __init__(self, dht: hivemind.DHT):
        self.dht = dht

    @classmethod
    def start(
        cls, host: str = "127.0.0.1", port: int = 0, initial_peers: list[str] | None = None,
        identity: Path | None = None,
    ) -> SwarmDHT:
        """Blocking (~0.5 s): start a DHT listening on host:port, joining `initial_peers` if given.
        `identity` (a key file, created if missing) keeps the peer id, hence the address nodes
        dialled, the same across restarts. Call from the main thread: the DHT process is told to
        die when the thread that forked it ends."""
        extra = {"identity_path": str(identity)} if identity is not None else {}
        try:
            dht = hivemind.DHT(
                initial_peers=initial_peers or None, start=True, host_maddrs=[f"/ip4/{host}/tcp/{port}"], **extra,
            )
        except Exception as e:  # hivemind raises bare Exception subclasses of its own for dial failures
            raise TransportError(f"could not start or join the DHT ({type(e).__name__}: {e})") from None
        dht.run_coroutine(_die_with_parent)
        return cls(dht)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def addresses(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def endpoint(self) -> Endpoint:
        """Stream endpoint in the caller's event loop, sharing the DHT's p2pd daemon."""
        return Endpoint(await self.dht.replicate_p2p())

    async def put(self, key: str, value: bytes, ttl: float, subkey: str | None = None, timeout: float = 15.0) -> bool:
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"DHT record {key} of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
        future = self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, return_future=True)
        return await self._wait(future, f"store {key}", timeout)

    async def get(self, key: str, timeout: float = 15.0) -> bytes | dict[str, bytes] | None:
        """The value (bytes), or {subkey: bytes} for a subkeyed record, or None. Entries of
        unexpected types are dropped here: the DHT is untrusted."""
        found = await self._wait(self.dht.get(key, latest=True, return_future=True), f"get {key}", timeout)
        if found is None:
            return None
        value = found.value
        if isinstance(value, bytes):
            return value
        if isinstance(value, dict):
            return {k: v.value for k, v in value.items() if isinstance(k, str) and isinstance(v.value, bytes)}
        return None

    @staticmethod
    async def _wait(future, what: str, timeout: float):
        # If the DHT process has died, its futures never resolve: never wait on one unbounded.
        # (asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation.)
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise TransportError(f"DHT {what}: no answer within {timeout:.0f} s (is the DHT process alive?)") from None

    def shutdown(self) -> None:
        self.dht.shutdown()

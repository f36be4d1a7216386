"""The swarm's DHT: the signed record that lets nodes find the run, and the transport beneath.

One record per run, under a key namespaced by the run key's fingerprint (what a volunteer pins in
its join command): `echo/<fp>/manifest`, the RunManifest, signed by the run key. Nodes announce
nothing here: the coordinator tells them who holds a version (`echo.holders`), and a record with
an entry per node cost every reader megabytes a read at a thousand nodes (docs/scaling.md).

A DHT without a validator stores whatever anyone sends. Every peer of a run installs
`RunRecords`, so its DHT stores and returns only that record: a forged manifest, a subkeyed
record, an unsigned tombstone or anything under another key is refused by every honest replica. Readers
still verify what they get (a reply may come from a replica that is not honest). Values stay
small (a DHT value of 256 KiB killed the DHT process in our measurements); tensors and batches
travel over streams.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

# hivemind reads these once at import; keep its and p2pd's logs to warnings unless asked.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
os.environ.setdefault("GOLOG_LOG_LEVEL", "error")

import hivemind  # noqa: E402
from hivemind.dht.protocol import DHTProtocol  # noqa: E402
from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.dht.validation import DHTRecord, RecordValidatorBase  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402
from hivemind.utils import MSGPackSerializer, get_dht_time  # noqa: E402

from protocols.errors import ProtocolError, TransportError  # noqa: E402
from protocols.messages import RunManifest  # noqa: E402
from protocols.signing import fingerprint, verify_message  # noqa: E402
from protocols.transport.streams import Endpoint  # noqa: E402

# Every DHT call is pickled through a pipe to the DHT process; past ~15.6 KiB pickled that process
# can die and a caller waits forever (measured). Our records are a few hundred bytes.
MAX_RECORD_BYTES = 8 * 1024
MAX_RECORD_TTL = 300.0  # seconds; our records are put for 60-120 s and refreshed well before
PR_SET_PDEATHSIG = 1
log = logging.getLogger(__name__)


async def _die_with_parent(_dht, _node) -> None:
    """Runs inside the DHT process: without this, a coordinator or node killed with SIGKILL leaves
    the DHT process and its p2pd daemon running forever, still holding the port and identity."""
    # The fork inherited the parent's SIGTERM handler (an asyncio one that does nothing here):
    # back to the default, so SIGTERM ends this process as it should.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _static_relays_only(make_process_args):
    """p2pd's relay discovery, which hivemind leaves on, turned off for a peer with trusted relays.

    With discovery on, libp2p's autorelay takes candidates from the DHT as well, waits 3 minutes
    (its boot delay) until it knows 4 of them, then reserves at 2 picked at random: a node behind
    NAT may never hold a reservation at the coordinator, whose relay the reachability probe and the
    peers dialling it go through. With static relays only, libp2p makes the trusted relay its one
    candidate and reserves there at once (go-libp2p 0.32 `autorelay.WithStaticRelays`). hivemind
    1.1.12 has no parameter for it, so the flag is added to the daemon's command line."""

    def make(*args, **kwargs):
        if kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_process_args(*args, **kwargs)

    return make


P2P._make_process_args = staticmethod(_static_relays_only(P2P._make_process_args))


def record_key(run_fingerprint: str, name: str) -> str:
    return f"echo/{run_fingerprint}/{name}"


class RunRecords(RecordValidatorBase):
    """The DHT's write rules for one run (see the module docstring). Runs inside the DHT process,
    on every record stored or fetched; anything it cannot parse is simply refused."""

    def __init__(self, run_fingerprint: str):
        self.fp = run_fingerprint
        self.manifest_key = DHTID.generate(source=record_key(run_fingerprint, "manifest")).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES + 64:  # msgpack's bin header on our bytes
            return False
        # Expirations are the storer's word: a replica could pin an old manifest for ever. No
        # record lives past MAX_RECORD_TTL from now.
        if record.expiration_time > get_dht_time() + MAX_RECORD_TTL:
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
            if not isinstance(value, bytes):
                return False
            if record.key == self.manifest_key and record.subkey == DHTProtocol.IS_REGULAR_VALUE:
                manifest = RunManifest.from_wire(value)
                verify_message(manifest, manifest.run_key)
                return fingerprint(manifest.run_key) == self.fp
        except (ProtocolError, ValueError, TypeError) as e:
            log.debug("DHT record refused: %s", e)
        return False


class SwarmDHT:
    """A hivemind DHT (its own process plus the p2pd daemon) with Echo's records on top."""

    def __init__(self, dht: hivemind.DHT):
        self.dht = dht
        self._replica: tuple[asyncio.AbstractEventLoop, P2P] | None = None  # `endpoint`'s, and its loop

    @classmethod
    def start(
        cls, host: str = "127.0.0.1", port: int = 0, initial_peers: list[str] | None = None,
        identity: Path | None = None, run_fingerprint: str | None = None, public: bool = False,
        relay: str | None = None,
    ) -> SwarmDHT:
        """Blocking (~0.5 s): start a DHT listening on host:port, joining `initial_peers` if given.
        `identity` (a key file, created if missing) keeps the peer id, hence the address nodes
        dialled, the same across restarts. `run_fingerprint`: store only that run's records
        (`RunRecords`); every peer of a run passes it. `public`: this peer is reachable (the
        coordinator), so it relays for peers behind NAT (libp2p runs the relay service only on a
        peer it believes public). `relay`: this peer cannot be dialled; it joins as a DHT client
        and holds a reservation at the peer `relay` (a multiaddr), through which others reach it.
        Call from the main thread: the DHT process is told to die when the thread that forked it ends."""
        # p2pd is a Go program: with Go's default GOGC=100 its RSS climbs from ~60 to ~87 MB over
        # its first thousand calls and stays there; GOGC=50 plateaus at ~71 MB at the same speed
        # (measured: 10,000 RPCs, two peers on 127.0.0.1). A volunteer's machine keeps the difference.
        os.environ.setdefault("GOGC", "50")
        extra = {"identity_path": str(identity)} if identity is not None else {}
        if public:
            extra["force_reachability"] = "public"
        if relay is not None:
            # Our only relay, reserved at once (`_static_relays_only`).
            extra.update(client_mode=True, use_auto_relay=True, force_reachability="private", trusted_relays=[relay])
        validators = [RunRecords(run_fingerprint)] if run_fingerprint else []
        try:
            dht = hivemind.DHT(
                initial_peers=initial_peers or None, start=True, host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                record_validators=validators, **extra,
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
        """An endpoint in the caller's event loop, sharing the DHT's p2pd daemon. One per loop
        (hivemind's `replicate_p2p` keeps one per process): its persistent connection to the
        daemon, which carries unary calls, is read by a task of the loop that opened it, and a
        replica from a finished loop answers no unary call (a process runs one loop; tests many)."""
        loop = asyncio.get_running_loop()
        if self._replica is None or self._replica[0] is not loop:
            daemon = self.dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr)
            self._replica = loop, await P2P.replicate(daemon)
        return Endpoint(self._replica[1])

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

"""Joining a run: its manifest, checked against the pinned run-key fingerprint, its trainer, the
signed list of its base model's chunks, and the base model itself (`--model`, checked against the
run's, or fetched from the swarm). Nothing of the run is used before it verifies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from echo_node.base_download import download, fetch_model_file, known_sha256, progress_line
from echo_node.config import JoinRefused, Stopped
from echo_node.session import Session, console
from echo_node.updates import UpdateError
from protocols import rpc
from protocols.errors import EchoError, ProtocolError, RemoteError, SignatureError, TransportError
from protocols.messages import ModelFile, RunManifest
from protocols.multiaddr import peer_of
from protocols.signing import fingerprint, verify_message
from protocols.supervise import retry

log = logging.getLogger(__name__)

MANIFEST_WAIT = 60.0  # seconds to find the run's manifest in the DHT before giving up
CALL_TIMEOUT = 60.0


class Phases:
    """Where a node's time went from its start to its first accepted rollout: each `mark` ends
    a phase (marks after the last phase are ignored; a phase seen again, say a lease whose push
    was refused, adds to the time since the previous mark)."""

    def __init__(self):
        self.started = self.previous = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.done = False

    def mark(self, phase: str, last: bool = False) -> bool:
        """End `phase` now; True when this ended the last phase."""
        if self.done:
            return False
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.previous
        self.previous, self.done = now, last
        return last

    def total(self) -> float:
        return self.previous - self.started

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.seconds.items())


def trainer_peer(manifest: RunManifest) -> str:
    for address in manifest.trainer_addrs:
        if "/p2p/" in address:
            return peer_of(address)
    raise JoinRefused("the run manifest names no trainer peer")


def verify_manifest(raw: bytes | RunManifest, run_key: str, address: str) -> RunManifest:
    """The manifest (wire bytes, or as a stream decoded it), if it is signed by the key whose
    fingerprint is `run_key`."""
    try:
        manifest = raw if isinstance(raw, RunManifest) else RunManifest.from_wire(raw)
    except ProtocolError as e:
        raise JoinRefused(f"the run's manifest is malformed: {e}") from None
    found = fingerprint(manifest.run_key)
    if found != run_key:
        raise JoinRefused(f"the run at {address} is signed by key {found}, not the key {run_key} you asked to trust")
    try:
        verify_message(manifest, manifest.run_key)
    except SignatureError as e:
        raise JoinRefused(f"the run's manifest signature is invalid: {e}") from None
    return manifest


async def fetch_manifest(session: Session, dht, endpoint) -> RunManifest:
    """The manifest from the DHT record under the pinned fingerprint; failing that (absent, or a
    record that does not verify: the DHT is not to be trusted), straight from the peer at the
    join address, whose answer is final, so a wrong key is reported at once, not after a wait.
    A poll of two sources once a second until a deadline, not a `retry`: a DHT that does not
    answer ends the node, and running out of time is a refusal, not the last call's error."""
    from protocols.transport.dht import record_key

    config = session.config
    key = record_key(config.run_key, "manifest")
    deadline = time.monotonic() + MANIFEST_WAIT
    coordinator = peer_of(config.address)
    session.waiting(f"looking for the run at {config.address} ...")
    while True:
        raw = await dht.get(key)
        if isinstance(raw, bytes):
            try:
                return verify_manifest(raw, config.run_key, config.address)
            except JoinRefused as e:
                log.warning("ignoring a bad manifest record in the DHT (%s); asking the coordinator", e)
        try:
            answer = await endpoint.call_one(coordinator, rpc.MANIFEST, idempotent=True)
        except ProtocolError as e:
            raise JoinRefused(f"the run's manifest is malformed: {e}") from None
        except (TransportError, RemoteError) as e:
            log.info("manifest not available yet: %s", e)
        else:
            return verify_manifest(answer, config.run_key, config.address)
        if time.monotonic() > deadline:
            raise JoinRefused(f"no run with key {config.run_key} found via {config.address} "
                              f"within {MANIFEST_WAIT:.0f} s; check the join line")
        await asyncio.sleep(1.0)


async def model_file(session: Session, endpoint, trainer: str, manifest: RunManifest) -> ModelFile:
    """The run's signed chunk list of its base model, from the trainer (retried while it cannot
    be reached)."""
    try:
        return await retry(lambda: fetch_model_file(endpoint, trainer, manifest, CALL_TIMEOUT), TransportError,
                           wait=session.pause_or_stop)
    except Stopped:
        raise Stopped("stopped before the run's base model was known") from None
    except (ProtocolError, SignatureError, UpdateError) as e:
        raise JoinRefused(f"the run's base model list is not valid: {e}") from None


async def base_model(session: Session, endpoint, trainer: str, manifest: RunManifest, listed: ModelFile,
                     holders: Callable[[], Awaitable[list[str]]]) -> Path:
    """`--model`, checked against the run's base; without it the base from the swarm (`holders`:
    peers said to hold it). Ctrl-C stops it; the same command resumes a download."""
    path = await session.until_stopped(_base_model(session, endpoint, trainer, manifest, listed, holders))
    if path is None:
        raise Stopped("stopped while fetching the base model; the same command resumes where it stopped")
    return path


async def _base_model(session: Session, endpoint, trainer: str, manifest: RunManifest, listed: ModelFile,
                      holders: Callable[[], Awaitable[list[str]]]) -> Path:
    own = session.config.model
    if own is not None:
        model_sha = await asyncio.to_thread(known_sha256, own, session.data_dir / "models")
        if model_sha != manifest.base_sha256:
            raise JoinRefused(
                f"your model {own.name} (sha256 {model_sha[:12]}) is not this run's base model "
                f"{manifest.base_model} (sha256 {manifest.base_sha256[:12]}); leave out --model "
                "to fetch it from the swarm")
        return own

    said = 0.0

    def show(done: int, total: int, seconds: float, fetched: int) -> None:
        nonlocal said
        line = progress_line(done, total, seconds, fetched)
        if session.status is not None:
            session.status.update(line)
        elif done == total or time.monotonic() - said > 2.0:
            said = time.monotonic()
            console.print(line)

    try:
        path, sources = await download(endpoint, trainer, holders, listed, session.disk, show, CALL_TIMEOUT)
    except (UpdateError, ProtocolError, TransportError) as e:
        raise EchoError(f"could not fetch the base model: {e}; run the same command to resume") from None
    if sources:
        from_trainer = sources.pop(trainer, 0)
        console.print(f"fetched the base model {manifest.base_model} ({listed.size / 1e6:.1f} MB): "
                      f"{sum(sources.values()) / 1e6:.1f} MB from {len(sources)} peers, "
                      f"{from_trainer / 1e6:.1f} MB from the coordinator")
    return path

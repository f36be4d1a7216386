"""Which version of the policy a node serves, and when it must move: before each lease it moves to
the lease's version, and a failed move is fatal only where the staleness gate says so."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path

from echo_node.presence import Presence
from echo_node.session import Session
from echo_node.updates import Shunned, UpdateError, apply_update, catch_up, check_manifest, load_lora, shapes
from protocols.messages import RunManifest, TaskLease, WeightUpdate
from protocols.supervise import retry
from protocols.transport.relay import Relay

log = logging.getLogger(__name__)

CALL_TIMEOUT = 60.0
BUSY_RETRY = 0.3  # seconds; the trainer's copy went to a peer that will relay it shortly


class Versions:
    """Owns `version`, the weights updates apply to (`master`) and, in full mode, the version the
    backend serves (`loaded`). Runs on the event loop; decoding and loading weights run in a
    worker thread, never while the generation thread uses the backend (the work loop awaits one
    before it starts the other)."""

    def __init__(self, session: Session, presence: Presence, trainer: str, manifest: RunManifest, backend,
                 master: dict | None, relay: Relay):
        self.session, self.presence, self.trainer, self.manifest = session, presence, trainer, manifest
        self.backend, self.relay = backend, relay
        self.version = 0  # the last version whose update was fully verified and applied
        self.loaded = 0  # full mode: the version the backend serves (master weights may be ahead mid-chain)
        # What updates apply to: the LoRA adapter (none at version 0), or full weights. None: full
        # mode's base weights, loaded only when a delta needs them (`_held`), so a late joiner's
        # snapshot is never decoded beside the base it replaces (an 8B base is 32 GB as float32).
        self.master = master
        self.base_shapes = None
        if master is None:
            from engines.hf import master_shapes

            self.base_shapes = master_shapes(backend.model_path)
        self.shunned = Shunned()  # providers that failed us, skipped for a while
        self.max_elements = getattr(backend, "n_params", None)  # what a first LoRA snapshot may declare

    async def prepare(self, lease: TaskLease) -> str | None:
        """Move to the lease's version before sampling: a lease fixes the one version its batch
        is sampled with (the trainer's newest, or in async mode ours once our update failed,
        `protocols.sync.lease_version`; an evaluation, its round's, given only to nodes not
        past it). Returns what `bring_to` does."""
        if lease.evaluation and lease.version < self.version:
            raise UpdateError(f"evaluation of version {lease.version}, but this node holds version {self.version}")
        return await self.bring_to(lease.version)

    async def bring_to(self, version: int) -> str | None:
        """Catch up to `version`; a line saying how (None when already there). On failure, the
        node keeps every update of the chain it verified and applied."""
        if version == self.version:
            return None
        started = time.perf_counter()
        self.session.waiting(f"updating from version {self.version} to {version} ...")

        async def attempt():
            return await catch_up(self.presence.endpoint, self.trainer, self.presence.peers_holding, self.manifest,
                                  self.version, version, self._apply, CALL_TIMEOUT, self.shunned, self._check)

        async def busy_wait(error: BaseException, delay: float) -> None:
            # The trainer sent its copy to another node (its upload budget; it lets one more
            # in if nobody relays): learn who holds it and retry soon, keeping our lease.
            self.presence.refresh()
            self.shunned.forgive()
            await asyncio.sleep(delay)

        try:
            chain = await retry(attempt, UpdateError, busy=lambda e: e.busy, busy_delay=BUSY_RETRY,
                                give_up=lambda e, delay: not e.busy, wait=busy_wait)
        finally:
            if self.manifest.update == "full" and self.loaded != self.version:
                await asyncio.to_thread(self._load_full_weights)  # whatever verified prefix we reached
        route = " + ".join(f"{'snapshot' if s.replaces else 'delta'} {s.from_version}->{s.to_version}" for s in chain)
        return f"updated to version {version} via {route} in {time.perf_counter() - started:.2f}s"

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return self.base_shapes if self.master is None else shapes(self.master)

    def _check(self, update: WeightUpdate) -> None:
        check_manifest(self._shapes(), update, self.max_elements)

    def _held(self) -> dict:
        if self.master is None:
            self.master = self.backend.base_weights()[1]
        return self.master

    async def _apply(self, update: WeightUpdate, store: dict[str, bytes], payloads: Mapping[str, bytes]) -> None:
        held = {} if update.replaces else await asyncio.to_thread(self._held)
        new = await asyncio.to_thread(apply_update, held, update, payloads, self.max_elements, self._shapes())
        new = new if update.replaces else {**held, **new}
        if update.mode == "lora":
            await load_lora(new, update, self.backend, self.session.disk)  # raises: nothing changed
        self.master = new
        self.version = update.to_version
        self.relay.remember(update, store)

    def _load_full_weights(self) -> None:
        """Full mode: bring the backend to the master weights (after a whole chain, once). They
        are written as a float32 GGUF, then requantized to a file as large as the base: room for
        both is made first (an 8B base: ~32 GB, then ~5 GB)."""
        from engines.hf import checkpoint_dir

        base = Path(self.backend.model_path)
        size = 4 * sum(w.size for w in self.master.values()) + base.stat().st_size
        self.session.disk.make_room(size, f"version {self.version}'s weights",
                                    keep=[base, checkpoint_dir(self.manifest.base_sha256)])
        self.backend.load_weights(self.master, self.version, self.session.data_dir / "weights")
        self.loaded = self.version

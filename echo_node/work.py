"""The work loop: lease -> move to the lease's version -> generate -> push, until the run ends.
A batch's push (the trainer verifying it) overlaps the next lease's generation, and at most one
push is in flight. Failures are retried with backoff; only a key the run does not admit, or a
background failure (see `main`), ends the node."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

from echo_node.config import JoinRefused
from echo_node.join import Phases
from echo_node.rollouts import Rollouts
from echo_node.schedule import Hours, idle_reason
from echo_node.session import Session, console
from echo_node.updates import UpdateError
from echo_node.versions import Versions
from engines.backend import BackendCrashed
from protocols import rpc
from protocols.errors import InvalidValue, ProtocolError, RemoteError, TransportError
from protocols.messages import HARDWARE_CHARS, LeaseRequest, NoWork, PushReceipt, RolloutBatch, RunManifest, TaskLease
from protocols.signing import sign_message
from protocols.supervise import retry

log = logging.getLogger(__name__)

# A node's first lease is one prompt's group: its first rollout is accepted sooner. Later it asks
# for as many as the trainer gives; the trainer sizes leases to its batch (`parallel`).
FIRST_LEASE_SEEDS = 1
# A round that failed so is tried again (BackendCrashed: llama.cpp died in its worker, which was restarted).
ROUND_FAILURES = (TransportError, ProtocolError, UpdateError, BackendCrashed)
IDLE_POLL = 2.0  # seconds between looks at the pause file and the clock while idle
CLOCK_SLACK = 600.0  # seconds a lease's expiry may lie in our past: the trainer's clock is not ours
LONGEST_LEASE = 86_400.0  # seconds: a lease further out would hold our one push slot for days
PUSH_BUSY_RETRY = 1.0  # seconds between pushes of a batch the trainer is too busy to judge yet


def check_lease(lease: TaskLease, asked: LeaseRequest, now: float) -> TaskLease:
    """The trainer's lease, held to what we asked for: our run and key, no more seeds than
    `max_seeds`, an expiry neither long past nor days away (it bounds how long we retry its push)."""
    if (lease.run_id, lease.node_id) != (asked.run_id, asked.node_id):
        raise InvalidValue(f"lease {lease.lease_id} is for run {lease.run_id} and key {lease.node_id[:12]}, "
                           f"not run {asked.run_id} and our key {asked.node_id[:12]}")
    if len(lease.seeds) > asked.max_seeds:
        raise InvalidValue(f"lease {lease.lease_id} has {len(lease.seeds)} seeds; we asked for at most {asked.max_seeds}")
    if not now - CLOCK_SLACK < lease.expires_at <= now + LONGEST_LEASE:
        raise InvalidValue(f"lease {lease.lease_id} expires {lease.expires_at - now:+.0f} s from now")
    return lease


class Work:
    """Owns what the loop learns: samples `accepted`, the `latest` version the trainer told of,
    and the push in flight. Event-loop side; generation runs in a worker thread."""

    def __init__(self, session: Session, endpoint, trainer: str, manifest: RunManifest, backend, versions: Versions,
                 rollouts: Rollouts, phases: Phases):
        self.session, self.endpoint, self.trainer, self.manifest = session, endpoint, trainer, manifest
        self.backend, self.versions, self.rollouts, self.phases = backend, versions, rollouts, phases
        self.accepted = 0  # samples the trainer accepted from us since we joined
        self.latest = 0  # the newest version the trainer told us of
        self.update_failed = False  # our last update to `latest` failed: lease requests say so
        self.pushing: asyncio.Task | None = None
        # A lease taken whose version this node could not move to yet (an update that broke off):
        # the next round tries again with it, not with a new lease.
        self.unstarted: TaskLease | None = None
        self.hours = Hours.parse(session.config.hours) if session.config.hours else None

    def say(self, event: str) -> None:
        version = self.versions.version
        self.session.say(event, f"{self.session.name}: version {version} (lag {max(0, self.latest - version)}) · "
                                f"{self.accepted} samples accepted · batch {self.backend.parallel} · "
                                f"{self.backend.throughput:.0f} tok/s")

    async def run(self) -> None:
        """Until the trainer says the run is finished."""
        try:
            # A round that generated a batch resets the backoff; waiting for work does not.
            while not await retry(self._round, ROUND_FAILURES, wait=self.session.pause):
                pass
        finally:
            if self.pushing is not None:
                self.pushing.cancel()  # stopping: the lease expires at the trainer, as with a batch cut short

    async def _round(self) -> bool:
        """Take a lease, generate its batch and start its push; True when instead the run is finished."""
        try:
            await self._until_working()
            lease = self._still_unstarted() or await self._next_lease()
            if lease is None:
                return True
            self.latest = max(self.latest, lease.version)
            try:
                moved = await self.versions.prepare(lease)
            except UpdateError:
                # Kept only across a failed update: a lease that cannot be generated (one whose
                # prompt the node refuses, say) must not be tried again for as long as it lasts.
                self.unstarted = lease
                raise
            if moved is not None:
                self.say(moved)
            self.phases.mark("first lease")
            self.say(f"{'evaluating' if lease.evaluation else 'generating'} {len(lease.seeds)} prompts")
            batch = await asyncio.to_thread(self.rollouts.generate, lease, self.versions.version)
            self.phases.mark("generation")
            if self.pushing is not None:
                await self.pushing
            self.pushing = asyncio.create_task(self._deliver(batch, lease.expires_at), name="push")
            return False
        except RemoteError as e:
            self.session.answered()
            if e.code == "not_allowed":
                raise self._not_admitted() from None
            raise

    def _still_unstarted(self) -> TaskLease | None:
        """The lease an earlier round took and could not move to the version of, while it lasts
        and this node can still sample it. Taking a new one instead left that one held at the trainer, its
        seeds with it, until it expired: a sequential step whose other seeds were all answered
        waited 305 s for a lease the node had dropped when one update attempt broke off."""
        lease, self.unstarted = self.unstarted, None
        if lease is None or time.time() >= lease.expires_at:
            return None
        if lease.evaluation and lease.version < self.versions.version:
            return None  # (an evaluation of a version this node is past: `Versions.prepare` refuses it)
        return lease

    async def _until_working(self) -> None:
        """Outside the volunteer's hours or while paused, wait (the push in flight goes on)."""
        said = None
        while (reason := idle_reason(self.hours, self.session.config.data_dir, datetime.now())) is not None:
            if reason != said:
                self.say(reason)
                said = reason
            await asyncio.sleep(IDLE_POLL)
        if said is not None:
            self.say("working again")

    async def _next_lease(self) -> TaskLease | None:
        """A lease, waiting while the trainer has no work; None once the run is finished (then
        the last push has been answered and the final version fetched)."""
        while True:
            reply = await self._request_lease()
            self.session.answered()
            if not isinstance(reply, NoWork):
                return reply
            if reply.finished:
                if self.pushing is not None:
                    await self.pushing
                await self._finish(reply.latest_version)
                return None
            self.latest = max(self.latest, reply.latest_version)
            if self.manifest.mode == "async" and self.latest > self.versions.version:
                # Async leases are of the trainer's version, or of ours once we say our update
                # failed (`protocols.sync.lease_version`): update, or say so, and ask again at once.
                said_failed = self.update_failed
                if await self._update() or not said_failed:
                    continue
            self.say("waiting for work")
            await asyncio.sleep(reply.retry_after)

    async def _update(self) -> bool:
        """Move to the latest version between leases; False (and said in lease requests) if it failed."""
        try:
            moved = await self.versions.bring_to(self.latest)
        except UpdateError as e:
            log.warning("could not update to version %d (%s); asking for work at version %d",
                        self.latest, e, self.versions.version)
            self.update_failed = True
            return False
        self.update_failed = False
        if moved is not None:
            self.say(moved)
        return True

    async def _request_lease(self) -> TaskLease | NoWork:
        s = self.session
        request = sign_message(LeaseRequest(
            run_id=self.manifest.run_id, node_key=s.node_key, peer_id=self.endpoint.peer_id, name=s.name,
            version=self.versions.version, max_seeds=64 if self.accepted else FIRST_LEASE_SEEDS, time=time.time(),
            backend=self.backend.name, parallel=self.backend.parallel, hardware=self.backend.hardware[:HARDWARE_CHARS],
            update_failed=self.update_failed and self.latest > self.versions.version,
        ), s.key)
        # Sent again once if the stream breaks: the trainer answers the same signed request with
        # the same lease, so a lost reply no longer leaves a lease to lapse against our key.
        reply = await self.endpoint.call_one(self.trainer, rpc.LEASE, request, idempotent=True)
        return reply if isinstance(reply, NoWork) else check_lease(reply, request, time.time())

    async def _deliver(self, batch: RolloutBatch, expires_at: float) -> None:
        """Push one batch and account for the answer. A refused or undeliverable batch is logged
        and left to expire at the trainer; only a key the run does not admit ends the node."""
        try:
            receipt = await self._push(batch, expires_at)
        except RemoteError as e:
            self.session.answered()
            if e.code == "not_allowed":
                raise self._not_admitted() from None
            log.warning("lease %s was refused: %s", batch.lease_id, e)
            return
        except (TransportError, ProtocolError) as e:
            log.warning("lease %s was not delivered: %s", batch.lease_id, e)
            return
        if receipt.accepted and self.phases.mark("push", last=True):
            console.print(f"first rollout accepted {self.phases.total():.1f} s after start "
                          f"({self.phases.summary()})")
        self.accepted += receipt.accepted
        self.latest = max(self.latest, receipt.latest_version)
        tokens = sum(len(x.completion_ids) for x in batch.samples)
        self.say(f"lease {batch.lease_id}: {receipt.accepted} samples ({tokens} tokens) accepted at version "
                 f"{batch.version}, {self.backend.throughput:.0f} tok/s")

    async def _push(self, batch: RolloutBatch, expires_at: float) -> PushReceipt:
        """Push until the trainer answers. A broken stream (the coordinator restarting, say) is
        retried while the lease lasts: a restarted coordinator still knows the lease, and what
        it acknowledges it keeps. A refusal is final."""

        async def attempt() -> PushReceipt:
            receipt = await self.endpoint.call_one(self.trainer, rpc.PUSH, batch.to_wire())
            self.session.answered()
            return receipt

        def busy(error: BaseException) -> bool:
            # Other new keys' batches are being judged, or this peer's pushes are at their limit:
            # no verdict, and a slot opens any moment. Asked again at a short, fixed interval up
            # to the lease's end (a growing backoff gave up with up to 8 s of the lease left).
            return isinstance(error, RemoteError) and error.code == "busy"

        async def wait(error: BaseException, delay: float) -> None:
            log.log(logging.INFO if busy(error) else logging.WARNING,
                    "pushing lease %s failed (%s); retrying in %.1f s while the lease lasts", batch.lease_id, error, delay)
            await asyncio.sleep(delay)

        def give_up(error: BaseException, delay: float) -> bool:
            # RemoteError: the trainer answered (stale, released, refused); pushing again cannot change that.
            refused = isinstance(error, RemoteError) and not busy(error)
            return refused or time.time() + delay >= expires_at

        return await retry(attempt, TransportError, wait=wait, give_up=give_up, busy=busy, busy_delay=PUSH_BUSY_RETRY)

    async def _finish(self, version: int) -> None:
        """Leave with the run's final policy if it can still be fetched; the run is over either way."""
        try:
            moved = await self.versions.bring_to(version)
        except (UpdateError, TransportError, ProtocolError) as e:
            console.print(f"the run is finished at version {version}; this node stays at version "
                          f"{self.versions.version} (the final update could not be fetched: {e})")
            return
        if moved is not None:
            self.say(moved)
        console.print(f"the run is finished at version {version}")

    def _not_admitted(self) -> JoinRefused:
        return JoinRefused(f"this run admits only listed node keys; ask its operator to add {self.session.fingerprint}")

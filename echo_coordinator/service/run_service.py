"""`RunService`: the one object the coordinator holds. It owns the lock and the parts, and every
call that changes a part takes the lock here (the push path, in `pushes`, takes it itself).

Lock discipline (docs/architecture.md): handlers run on the transport's thread pool, the step
loop elsewhere; the lock is taken to look up and to commit, never across I/O. Journal writes are
queued under it, so they land in the order the state changed, and waited for outside it.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from concurrent.futures import Future

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo_coordinator.capacity import Throughput
from echo_coordinator.evaluation import EvalSet
from echo_coordinator.journal import Journal
from echo_coordinator.ledger import Ledger
from echo_coordinator.service.buffer import StepBatch, TrainingBuffer, Unchecked
from echo_coordinator.service.evaluating import EvalRounds
from echo_coordinator.service.leasing import Leasing
from echo_coordinator.service.policing import Policing
from echo_coordinator.service.pushes import Pushes, Queued
from echo_coordinator.service.registry import Registry
from echo_coordinator.service.settings import LeaseSettings, Work
from engines.episodes import Transcripts
from protocols.errors import InvalidValue, PeerRefused
from protocols.messages import LeaseRequest, NoWork, PushReceipt, RunManifest, TaskLease, WeightUpdate
from protocols.signing import verify_message
from protocols.sync import Mode, ReplayBuffer, RolloutGate
from protocols.transport.relay import Relay

REQUEST_MAX_AGE = 300.0  # seconds; older signed lease requests are replays
RETRY_AFTER = 0.5  # seconds a node waits after NoWork


class RunService:
    """Leases and pushes for one run, and what the step loop takes from them."""

    def __init__(self, manifest: RunManifest, run_key: Ed25519PrivateKey, ledger: Ledger, work: Work,
                 settings: LeaseSettings, policing: Policing, relay: Relay | None = None):
        self.manifest, self.run_key, self.ledger = manifest, run_key, ledger
        self.work, self.settings, self.policing = work, settings, policing
        self.mode = Mode(manifest.mode)
        self.relay = relay or Relay()  # serves published updates (manifests, index, chunks) to nodes
        self.journal = Journal(ledger)
        self.lock = threading.Lock()  # handlers run on the transport's loop, the step loop elsewhere
        # Lease ids must never repeat across restarts (the gate remembers accepted ones): evaluation
        # books get a fresh prefix each start; the training book is restored, counter and all.
        prefix = f"{secrets.token_hex(3)}-"
        self.nodes = Registry()
        self.leasing = Leasing(manifest, work.render_prompt, settings, prefix)
        self.rounds = EvalRounds(work.evaluation, manifest.run_id, settings.lease_seconds, prefix,
                                 settings.seeds_per_lease * manifest.group_size)
        self.buffer = TrainingBuffer(self.mode, manifest.staleness, self.journal)
        self.pushes = Pushes(self.lock, manifest, work, ledger, policing, self.nodes, self.leasing, self.rounds,
                             self.buffer)

    # -- read-only views -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.buffer.version

    @property
    def started(self) -> bool:
        return self.leasing.started

    @property
    def finished(self) -> bool:
        return self.leasing.finished

    @property
    def replay(self) -> ReplayBuffer:
        return self.buffer.replay

    @property
    def gate(self) -> RolloutGate:
        return self.buffer.gate

    @property
    def throughput(self) -> Throughput:
        return self.nodes.throughput

    @property
    def transcripts(self) -> Transcripts:
        return self.work.transcripts

    @property
    def evaluation(self) -> EvalSet | None:
        return self.work.evaluation

    # -- the run's phases, set by the coordinator ------------------------------------------------

    def begin(self, now: float | None = None) -> None:
        """Work is handed out from now on (the step loop starts: min_nodes reached)."""
        with self.lock:
            self.leasing.started = True
            self.nodes.serving(time.time() if now is None else now)

    def end_training(self) -> None:
        """The last step is taken: only evaluation work is left."""
        with self.lock:
            self.leasing.training = False

    def finish(self) -> None:
        """Nothing left to train: nodes are told the run is over, and the relay serves every node
        its final fetch itself (no upload budget turns one away to fetch from a peer)."""
        with self.lock:
            self.leasing.finished = True
            self.relay.budget = None

    def talked(self) -> dict[str, str]:
        """Node id -> the libp2p peer it asked for work from."""
        with self.lock:
            return dict(self.nodes.talked)

    def relay_holders(self, now: float) -> tuple[dict[str, int], frozenset[str]]:
        """libp2p peer -> version it holds, of the keys working lately, and the proven ones among
        them (`Registry.relay_holders`)."""
        with self.lock:
            return self.nodes.relay_holders(now, self.version)

    # -- driven by the step loop -----------------------------------------------------------------

    def open_step(self, seeds: list[int]) -> None:
        """Sequential mode: lease exactly these seeds at the current version (after a restart,
        those the restored book and buffer do not already hold)."""
        with self.lock:
            self.leasing.open_step(seeds, buffered=self.buffer.seeds())
            saved = self.journal.save(self.leasing.book_state())
        saved.result()

    def step_done(self, now: float) -> bool:
        """Sequential mode: every seed of the step has been answered."""
        with self.lock:
            book = self.leasing.book
            book.expire(now)
            return book.pending_count == 0 and not book.outstanding

    def buffered_groups(self) -> int:
        with self.lock:
            saved = self.buffer.prune()
            count = len(self.buffer.replay)
        if saved:
            saved.result()
        return count

    def take_batch(self, groups: int | None = None) -> StepBatch:
        """Take up to `groups` groups (all if None) that the staleness bound still admits, for
        the step from the current version. Their nodes are credited by `commit_step`, once the
        step is saved: a group that goes stale in the buffer, or whose step dies in a crash, is
        not credited (the latter is trained on again after the restart)."""
        with self.lock:
            batch, saved = self.buffer.take(groups)
        saved.result()
        return batch

    def settle(self, verdicts: list[tuple[Unchecked, str | None]], now: float | None = None) -> None:
        """The step's verdicts on its unchecked batches (`Pushes.settle`), before it is committed."""
        self.pushes.settle(verdicts, time.time() if now is None else now)

    def commit_step(self, version: int) -> None:
        """The step from `version` is checkpointed: credit the groups it trained on."""
        self.journal.commit_step(version).result()

    def publish(self, updates: list[tuple[WeightUpdate, dict[str, bytes]]]) -> None:
        """Serve `updates` (all ending at one new version: a delta and maybe a snapshot) and make
        that version current."""
        with self.lock:
            for update, chunks in updates:
                self.relay.remember(update, chunks)
            if self.relay.latest_version > self.buffer.version:
                self.buffer.gate.advance(self.relay.latest_version)
            self.nodes.throughput.published_version(self.buffer.version, time.time())

    def open_eval(self, version: int, weights: dict | None, now: float | None = None) -> None:
        """Evaluate `version` (`weights`: what nodes hold at it, for verification)."""
        now = time.time() if now is None else now
        with self.lock:
            self.rounds.start(version, weights, now)

    def take_eval_records(self, give_up: bool = False, now: float | None = None) -> list[dict]:
        """Finished evaluation rounds since the last call; `give_up`: end the open ones too, as they stand."""
        now = time.time() if now is None else now
        with self.lock:
            return self.rounds.take_records(give_up, now)

    def evaluating(self) -> bool:
        with self.lock:
            return bool(self.rounds.open)

    def state(self, now: float | None = None) -> dict:
        """What `state.json` keeps of the service besides the version: the gate's counters and the
        nodes working now. (Its accepted lease ids are in the journal, written as they are
        accepted: a file rewritten each step must not grow with the run.)"""
        with self.lock:
            return {"gate": self.buffer.gate.to_dict(keys=False),
                    "working": self.nodes.working(time.time() if now is None else now)}

    def restore(self, state: dict, version: int) -> None:
        """After a restart at `version` (the checkpoint's): the gate, and from the journal every
        accepted group not yet trained on and the training leases, so the staleness bound and
        single-use leases hold across the restart (cf. AReaL #1388) and nodes push what they hold;
        and the nodes working before it, told the run's end even if it comes before they ask."""
        recovered = self.journal.recover(version, self.buffer.oldest_admitted(version))
        with self.lock:
            self.nodes.expect(state.get("working", []))
            self.buffer.restore(state["gate"], version, recovered)
            if "leases" in recovered.values:
                self.leasing.restore(recovered.values)

    def all_told_finished(self, now: float) -> bool:
        with self.lock:
            books = [self.leasing.book, *self.rounds.books()]
            holding = {x.node_id for b in books for x in (*b.outstanding, *b.shadows) if x.expires_at > now}
            return self.nodes.all_told_finished(now, holding)

    def told_behind(self) -> bool:
        """Some node heard the run is over while holding an older version: it fetches the last."""
        with self.lock:
            return any(v < self.buffer.version for v in self.nodes.told_finished.values())

    def prune(self, now: float, idle: float = 600.0) -> None:
        """Forget keys that have not asked for work in `idle` seconds (names, rate buckets): keys
        are free, so what the service keeps per key must not grow with every key ever seen."""
        with self.lock:
            self.nodes.prune(now, idle)

    # -- for the dashboard and the status line ---------------------------------------------------

    def expired_leases(self) -> int:
        """Training leases that expired unanswered since this start (their seeds were leased again)."""
        with self.lock:
            return self.leasing.book.expired_count

    def rejection_counts(self) -> Counter[str]:
        """Samples refused so far, by reason (a copy: handler threads keep counting)."""
        with self.lock:
            counts = Counter(self.pushes.rejections)
            if self.buffer.stale_dropped:
                counts["stale"] += self.buffer.stale_dropped
            return counts

    def live(self, now: float) -> dict:
        """What only the running process knows, for the dashboard: run state and, per node seen in
        the last `prune` window, its backend, held version and measured throughput."""
        with self.lock:
            book = self.leasing.book
            holding = Counter(lease.node_id for lease in (*book.outstanding, *book.shadows))
            return dict(started=self.leasing.started, finished=self.leasing.finished, version=self.buffer.version,
                        buffered_groups=len(self.buffer.replay), outstanding_leases=len(book.outstanding),
                        update_seconds=self.nodes.throughput.update_seconds(), nodes=self.nodes.nodes(now, holding),
                        unsigned=dict(self.pushes.unsigned))

    # -- handlers --------------------------------------------------------------------------------

    def handle_lease(self, request: LeaseRequest, peer_id: str = "", now: float | None = None) -> TaskLease | NoWork:
        """`peer_id`: the libp2p peer the request came from (the transport's word, not the request's)."""
        reply, saved = self.issue_lease(request, peer_id, now)
        if saved is not None:
            saved.result()
        return reply

    def issue_lease(self, request: LeaseRequest, peer_id: str = "",
                    now: float | None = None) -> tuple[TaskLease | NoWork, Future | None]:
        """`handle_lease` less its wait: the reply, and the journal write that must commit before
        it is sent (a training lease is in the journal before the node has it), or None. The
        stream handler waits for that write on its event loop, holding no lease thread."""
        now = time.time() if now is None else now
        verify_message(request, request.node_key)
        if request.run_id != self.manifest.run_id:
            raise InvalidValue(f"lease request for run {request.run_id!r}, this is {self.manifest.run_id!r}")
        if abs(now - request.time) > REQUEST_MAX_AGE:
            raise InvalidValue(f"lease request time is {now - request.time:.0f} s off; check the node's clock")
        self.policing.admit(self.ledger, request.node_id, now)
        with self.lock:
            self.nodes.heard(request, peer_id, now)
            if self.leasing.finished:
                self.nodes.told_finished[request.node_id] = request.version
                return NoWork(self.buffer.version, RETRY_AFTER, finished=True), None
            if (again := self.nodes.repeated(request)) is not None and self._held(again, now):
                return again, None  # the node lost our reply: the same lease, not a second one to lapse
            proven = self.nodes.proven(request.node_id, now)
            work = self.leasing.lease(request, now, self.buffer.version, len(self.buffer.replay), self.rounds, proven)
            if work is None:
                return NoWork(self.leasing.told(self.buffer.version), RETRY_AFTER), None
            self.nodes.lease_given(request, work)
            # A shadow lease changes nothing a restart needs (`LeaseBook.shadow`).
            unsaved = work.evaluation or self.leasing.book.is_shadow(work.lease_id)
            saved = None if unsaved else self.journal.save(self.leasing.book_state())
        try:
            # Judged outside the lock: a ban recorded while this lease was issued released the
            # key's leases before this one existed; a ban recorded after this look releases it.
            self.policing.admit(self.ledger, request.node_id, now)
        except PeerRefused:
            self.pushes.release(request.node_id, now)
            raise
        return work, saved

    def _held(self, lease: TaskLease, now: float) -> bool:
        """Under the lock: is `lease` still out to its key, to be answered?"""
        round_ = self.rounds.round_of(lease.lease_id)
        held = (self.leasing.book if round_ is None else round_.book).find(lease.lease_id, now)
        return held is not None and held.node_id == lease.node_id

    def handle_push(self, data: bytes, peer_id: str, now: float | None = None) -> PushReceipt:
        """Judge a pushed batch (wire bytes) and buffer its groups (`pushes`). Credit comes later,
        when a step trains on them."""
        return self.pushes.handle(data, peer_id, time.time() if now is None else now)

    def receive_push(self, data: bytes, peer_id: str) -> PushReceipt | Queued:
        """`handle_push` for the stream handler: a new key's batch comes back `Queued`, to be
        judged in turn on the new keys' threads."""
        return self.pushes.receive(data, peer_id, time.time())

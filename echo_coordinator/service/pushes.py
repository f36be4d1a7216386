"""The push path: a node's signed batch for one lease, judged and buffered (or refused).

A push is judged in three parts so that a slow batch never stalls the other handlers: under the
lock, look up its lease and bind its version to it; outside the lock, check the samples, replay
every episode for its reward and verify the sampling (`policing`); under the lock again, commit:
the rollout gate, the lease, the replay buffer. When the lease holder's signed batch is refused
the lease is released and its seeds go straight to the next node that asks. A batch's groups
are in the journal before its push is acknowledged. Evaluation answers take the same path to a
different end: scored for held-out accuracy, credited at once, never trained on.

A new key's batch is always verified, behind the trainer's other work, and keys are free: its
signature checked, it waits in the new keys' line (`Queued`: its bytes, no thread; its lease does
not expire meanwhile) and is judged on one of NEW_KEY_PUSHES threads of its own, in turn. Past
the line's size it is told `busy` (push again shortly: no verdict). A crowd of new nodes that were
all told `busy` pushed again every second, each push paying its transfer and checks again, and
slowed every other call (docs/scaling.md, "The flash crowd's busy storm").
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

from echo_coordinator.evaluation import EvalRound
from echo_coordinator.ledger import Ledger
from echo_coordinator.service import judging
from echo_coordinator.service.buffer import TrainingBuffer, Unchecked
from echo_coordinator.service.evaluating import EvalRounds
from echo_coordinator.service.leasing import Leasing
from echo_coordinator.service.policing import Policing
from echo_coordinator.service.registry import Registry
from echo_coordinator.service.settings import Work
from engines.episodes import score
from protocols.errors import Beaten, InvalidValue, LeaseError, PeerRefused, ProtocolError, Truncated
from protocols.messages import PushReceipt, RolloutBatch, RunManifest
from protocols.leases import Lease, LeaseBook
from protocols.sync import Mode, Verdict, judge_version


NEW_KEY_PUSHES = 4  # new keys' batches judged at once: their own threads (echo_coordinator.handlers)
NEW_KEY_LINE_BYTES = 64 * 2**20  # new keys' batches waiting their turn, by size; past it they are told busy


SAVED: Future = Future()  # what a batch sent again after it was taken waits for: nothing
SAVED.set_result(None)


@dataclass(eq=False)
class Queued:
    """A new key's batch, its signature checked, waiting in the new keys' line: `judge` it on one
    of their threads, or `abandon` it if nobody waits for the answer any more."""

    pushes: Pushes
    data: bytes  # the wire bytes (decoded again when its turn comes: bytes are the smallest to hold)
    peer_id: str
    pinned: tuple[LeaseBook, str] | None  # its lease, kept from expiring while it waits
    state: str = "waiting"  # -> "judging" | "abandoned"

    def judge(self, now: float | None = None) -> PushReceipt:
        return self.pushes.judge_queued(self, time.time() if now is None else now)

    def abandon(self) -> None:
        self.pushes.leave_line(self, "abandoned")


class Pushes:
    """Judges pushes against the service's parts. It takes the service's lock itself, since it
    must let go of it while judging; nothing else here is touched without it."""

    def __init__(self, lock: threading.Lock, manifest: RunManifest, work: Work, ledger: Ledger, policing: Policing,
                 nodes: Registry, leasing: Leasing, rounds: EvalRounds, buffer: TrainingBuffer):
        self.lock, self.manifest, self.work, self.ledger, self.policing = lock, manifest, work, ledger, policing
        self.mode = Mode(manifest.mode)
        self.nodes, self.leasing, self.rounds, self.buffer = nodes, leasing, rounds, buffer
        self.judging: set[tuple[str, str]] = set()  # (lease id, signer) of batches being judged now
        self.rejections: Counter[str] = Counter()  # samples refused by reason (the buffer counts its stale drops)
        self.unsigned: Counter[str] = Counter()  # pushes refused before a key could be named (since start)
        self.line_bytes = 0  # new keys' batches in their line (`Queued`), waiting or being judged
        self.told_again = 0  # samples of batches sent again after they were taken: told so, not taken twice

    def handle(self, data: bytes, peer_id: str, now: float) -> PushReceipt:
        """Judge a pushed batch (wire bytes) on this thread, a new key's too, and buffer its
        groups. Credit comes later, when a step trains on them."""
        reply = self.receive(data, peer_id, now)
        return reply.judge(now) if isinstance(reply, Queued) else reply

    def receive(self, data: bytes, peer_id: str, now: float) -> PushReceipt | Queued:
        """A proven key's batch judged (`handle`); a new key's put in line (`Queued`), or refused `busy`."""
        node_id, body = self._signed(data)
        # Admission (allow-list, ban) on the signed key, before the batch's samples are decoded or
        # it takes a place in the new keys' line: a banned key's pushes cost a signature check.
        self._admit(node_id, now)
        if self.policing.verifier is not None and self.ledger.trust(node_id).new:
            return self._line_up(data, peer_id, node_id, body.get("lease_id"), now)
        return self._receive(node_id, body, peer_id, now)

    def _signed(self, data: bytes) -> tuple[str, dict]:
        try:
            return RolloutBatch.signed_body(data)
        except ProtocolError as e:
            # Whoever sent it cannot be named: no ledger row changes, not even the claimed key's.
            with self.lock:
                self.rejections[e.code] += 1
                self.unsigned[e.code] += 1
            raise

    def _line_up(self, data: bytes, peer_id: str, node_id: str, lease_id: object, now: float) -> Queued:
        with self.lock:
            book, lease = None, None
            if isinstance(lease_id, str):  # (from the signed body, not yet decoded)
                round_ = self.rounds.round_of(lease_id)
                book = self.leasing.book if round_ is None else round_.book
                lease = book.find(lease_id, now)
            held = lease is not None and lease.node_id == node_id
            if self.line_bytes + len(data) > NEW_KEY_LINE_BYTES:
                if held:
                    book.excuse(lease_id, node_id)  # if it ends before this key's turn, the wait was ours
                raise PeerRefused("busy", "new keys' batches fill their line; push again shortly")
            self.line_bytes += len(data)
            if held:
                book.pin(lease_id)  # our line is not the key's delay (`LeaseBook.pin`)
        return Queued(self, data, peer_id, (book, lease_id) if held else None)

    def judge_queued(self, queued: Queued, now: float) -> PushReceipt:
        with self.lock:
            if queued.state != "waiting":
                raise PeerRefused("busy", "this push was given up while it waited")
            queued.state = "judging"
        try:
            node_id, body = self._signed(queued.data)  # (checked when it joined the line)
            return self._receive(node_id, body, queued.peer_id, now)
        finally:
            self.leave_line(queued, "judged")

    def leave_line(self, queued: Queued, state: str) -> None:
        """`queued` leaves the line: judged, or abandoned before its turn (then it is never judged)."""
        with self.lock:
            if state == "abandoned" and queued.state != "waiting":
                return  # being judged: it leaves when that ends
            queued.state = state
            self.line_bytes -= len(queued.data)
            if queued.pinned is not None:
                book, lease_id = queued.pinned
                book.unpin(lease_id)

    def _receive(self, node_id: str, body: dict, peer_id: str, now: float) -> PushReceipt:
        with self.lock:
            name = self.nodes.name(node_id)
        samples = 1  # what a batch that does not even decode is counted as
        try:
            batch = RolloutBatch.from_dict(body)
            samples = len(batch.samples)
            saved = self._accept(batch, peer_id, name, now)
        except Beaten:
            raise  # it lost a race for its seeds: work lost, no bad input (its proof is counted)
        except ProtocolError as e:
            with self.lock:
                self.rejections[e.code] += samples
            self.ledger.reject(node_id, peer_id, name, e.code, samples, now)
            raise
        if saved is None:  # an evaluation answer
            tokens = sum(sum(s.loss_mask) for s in batch.samples)
            self.ledger.credit_eval(node_id, peer_id, name, len(batch.samples), tokens, now)
        else:
            saved.result()  # in the journal before the node hears it was accepted
        return PushReceipt(accepted=len(batch.samples), rejected=0,
                           latest_version=self.leasing.told(self.buffer.version))

    def _accept(self, batch: RolloutBatch, peer_id: str, name: str, now: float) -> Future | None:
        """Judge a batch and buffer its groups; returns the journal write to wait for (None for
        an evaluation answer: scored, nothing to train on)."""
        if batch.run_id != self.manifest.run_id:
            raise InvalidValue(f"batch for run {batch.run_id!r}, this is {self.manifest.run_id!r}")
        self._admit(batch.node_id, now)  # again: a ban may have come while it waited in line
        return self._judge(batch, peer_id, name, now)

    def _admit(self, node_id: str, now: float) -> None:
        """Refuse a key off the allow-list or serving a ban (`Policing.admit`)."""
        try:
            self.policing.admit(self.ledger, node_id, now)
        except PeerRefused:
            # A lease can be given in the moment of a ban (issue 36 point 11): its push is the
            # first word of it, and its seeds must not wait out the lease.
            self.release(node_id, now)
            raise

    def _judge(self, batch: RolloutBatch, peer_id: str, name: str, now: float) -> Future | None:
        started = time.monotonic()
        judging_now = (batch.lease_id, batch.node_id)  # keyed by signer too: nobody can block another's push
        with self.lock:
            if judging_now in self.judging:
                # The same lease pushed again (from any number of peers) while we judge it: one
                # replay and one verification per lease, never more.
                raise LeaseError(f"lease {batch.lease_id} is already being judged")
            self.judging.add(judging_now)
            round_ = self.rounds.round_of(batch.lease_id)
        book = self.leasing.book if round_ is None else round_.book
        beaten = False  # another lease's answer completed its seeds first: judged for the key's proof only
        pinned = False  # its lease waits for the verdict (only the holder's batch gets that far)
        try:
            with self.lock:
                if book.completed_by(batch.lease_id) == batch.node_id:
                    # Its holder did not hear our answer (a broken stream) and sent it again: it
                    # was taken (it is in the journal, or an evaluation answer was credited).
                    self.told_again += len(batch.samples)
                    return SAVED
                lease = self._held_lease(batch, now, round_)
                book.pin(batch.lease_id)  # our time judging it is not the node's: the lease waits
                pinned = True
                beaten = book.beaten(batch.lease_id, batch.node_id) is not None
                if round_ is None:
                    self.nodes.lease_answered(batch.node_id)
                prompts = {seed: self.leasing.prompt(seed) if round_ is None else self.rounds.evaluation.prompts[seed]
                           for seed in lease.seeds}
            # Judged without the lock: replay and verification take a while, other handlers go on.
            per_seed = self.manifest.group_size if round_ is None else round_.samples
            judging.check_samples(batch, prompts, per_seed, self.manifest.vocab_size)
            # Rewards are recomputed here by replaying each episode; nothing the node says counts.
            task = self.work.task_of(evaluation=round_ is not None)
            try:
                rewards = [score(task, s, self.work.transcripts) for s in batch.samples]
            except Truncated:
                # Honest tokens cut to shape are as much a cheat as written ones, and this check
                # is on every batch, spot-checked or not.
                self.policing.strike(self.ledger, batch.node_id, now)
                raise
            waits = self.policing.verify(self.ledger, batch, now, round_, current=self.buffer.version)
            now += time.monotonic() - started  # (its lease was pinned: it has not expired meanwhile)
            groups = [] if round_ is not None else judging.groups(batch, rewards, peer_id, name, unchecked=waits)
            with self.lock:
                # Another key's answer may have completed these seeds while this batch was judged.
                beaten = beaten or book.beaten(batch.lease_id, batch.node_id) is not None
                if beaten:
                    if not waits:  # verified: the key delivered, as a proven key does
                        self.nodes.throughput.pushed(batch.node_id, len(batch.samples), lease.issued_at, now)
                    raise Beaten(f"lease {batch.lease_id}'s seeds were answered first by another key: this batch "
                                 f"{'passed and proves this key' if not waits else 'is not judged'}, but is not trained on")
                self._held_lease(batch, now, round_)
                if round_ is None:
                    self.buffer.offer(batch)
                book.complete(batch.lease_id, batch.node_id, now)
                self.nodes.throughput.pushed(batch.node_id, len(batch.samples), lease.issued_at, now)
                if round_ is not None:
                    self.rounds.answered(round_, batch, rewards, now)
                    return None
                for group in groups:
                    self.leasing.answered(group.seed)
                return self.buffer.add(batch, groups, self.leasing.book_state())
        except ProtocolError:
            # The holder's (signed) attempt failed: its seeds go straight back to other nodes, and
            # so do those of its other leases if that was a strike: a banned key never answers them.
            self.release(batch.node_id, now, batch.lease_id, book)
            raise
        finally:
            with self.lock:
                self.judging.discard(judging_now)
                if pinned:
                    book.unpin(batch.lease_id)
                if beaten:
                    book.drop_beaten(batch.lease_id)

    def settle(self, verdicts: list[tuple[Unchecked, str | None]], now: float) -> None:
        """The verdicts (None, or the reason it was refused) on the batches a step verified
        (`Group.unchecked`): what each means for its key (`Policing.settle`), and a refused one's
        groups out of the journal's buffer, never credited. Called before the step is committed."""
        refused = [(u, reason) for u, reason in verdicts if reason is not None]
        with self.lock:
            for u, reason in refused:
                self.rejections[reason] += len(u.samples)
            saved = [self.buffer.journal.refuse(list(u.groups), reason) for u, reason in refused]
        for u, reason in verdicts:
            self.policing.settle(self.ledger, u.groups[0].node_id, reason, len(u.samples), now)
            if reason is not None:
                self.release(u.groups[0].node_id, now)
        for write in saved:
            write.result()

    def release(self, node_id: str, now: float, lease_id: str | None = None, book=None) -> None:
        """After a refusal: `node_id`'s lease `lease_id` in `book` goes back to other nodes; all its
        leases if the refusal banned it."""
        banned = self.ledger.trust(node_id).banned(now)
        with self.lock:
            for b in [self.leasing.book, *self.rounds.books()] if banned else [book] if book else []:
                for x in (*b.outstanding, *b.shadows):
                    if x.node_id == node_id and (banned or x.lease_id == lease_id):
                        b.release(x.lease_id, x.node_id, now)

    def _held_lease(self, batch: RolloutBatch, now: float, round_: EvalRound | None) -> Lease:
        """Under the lock: the lease this batch answers (in `round_`'s book for an evaluation),
        outstanding or late but still open (`LeaseBook.find`) or beaten to its seeds
        (`LeaseBook.beaten`), held by its signer, admitting its version."""
        book = self.leasing.book if round_ is None else round_.book
        lease = book.find(batch.lease_id, now) or book.beaten(batch.lease_id, batch.node_id)
        if lease is None:
            book.complete(batch.lease_id, batch.node_id, now)  # raises the precise LeaseError
            raise LeaseError(f"lease {batch.lease_id} is not outstanding")
        if lease.node_id != batch.node_id:
            raise LeaseError(f"lease {batch.lease_id} belongs to another node")
        judging.check_claimed_version(lease.version if round_ is None else round_.version, batch.version)
        if round_ is not None:
            return lease
        if judge_version(self.mode, self.buffer.version, self.manifest.staleness, batch.version) is not Verdict.ACCEPT:
            self.buffer.offer(batch)  # already too old (or early): refuse now, before paying for replay and verification
        return lease

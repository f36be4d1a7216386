"""What the coordinator answers to nodes: leases and rollout pushes (updates are served by its relay).

Transport-free: every handler takes the request and returns a message, raising a `ProtocolError`
subclass for anything it refuses (the transport turns that into an ErrorReply and the ledger
counts it against the key that signed the request; an unsigned or forged one touches no row).

A push is judged in three parts so that a slow batch never stalls the other handlers: under the
lock, look up its lease and bind its version to it; outside the lock, check the samples, replay
every episode for its reward and verify the sampling (`verify`); under the lock again, commit:
the rollout gate, the lease, the replay buffer. When the lease holder's signed batch is refused
the lease is released and its seeds go straight to the next node that asks. Nothing accepted is
ever lost: a batch's groups are in the journal (`journal.py`) before its push is acknowledged,
and every training lease before it is handed out, so a restarted coordinator goes on with both.
Evaluation leases (`evaluation`) take the same path to a different end: scored for held-out
accuracy, credited at once, never trained on.
"""

from __future__ import annotations

import dataclasses
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo_coordinator.capacity import Throughput
from echo_coordinator.evaluation import EvalRound, EvalSet
from echo_coordinator.journal import Group, Journal
from echo_coordinator.ledger import Ledger
from echo_coordinator.peers import BanRule, RateLimit, SpotCheck
from echo_coordinator.rewards import Transcripts, score
from echo_coordinator.trainer import TrainSample
from echo_coordinator.verify import Verifier
from protocols.errors import InvalidValue, LeaseError, PeerRefused, ProtocolError, VerificationError
from protocols.messages import (
    LeaseRequest, NoWork, PushReceipt, RolloutBatch, RunManifest, TaskLease, WeightUpdate,
)
from protocols.signing import verify_message
from protocols.transport.relay import Relay
from protocols.sync import Lease, LeaseBook, Mode, ReplayBuffer, RolloutGate, Verdict, judge_version, lease_admits
from tasks import Task

REQUEST_MAX_AGE = 300.0  # seconds; older signed lease requests are replays
RETRY_AFTER = 0.5  # seconds a node waits after NoWork
MAX_LEASES_PER_KEY = 2  # outstanding at once: one in generation, one whose push is being retried
MAX_OPEN_EVALS = 4  # evaluation rounds open at once; opening another gives up the oldest
LEASE_RATE = RateLimit(rate=4.0, burst=8.0)  # lease requests per key; an honest node asks every 0.5 s at most


@dataclass(frozen=True)
class Policing:
    """How the service polices peers: verification, spot checks, bans, the allow-list."""

    verifier: Verifier | None  # None: sampling is not verified (tests of other rules only)
    spot: SpotCheck = SpotCheck()
    bans: BanRule = BanRule()
    allow: frozenset[str] | None = None  # node key fingerprints; None = anyone may join


class Refused(ProtocolError):
    """A batch the rollout gate turned down; `code` is the verdict: stale, future, duplicate or
    wrong_version, so ledger and metrics count each reason apart."""

    def __init__(self, verdict: Verdict, message: str):
        super().__init__(message)
        self.code = verdict.value


@dataclass
class StepBatch:
    samples: list[TrainSample]
    rewards: list[float]
    staleness: list[int]  # per sample: trainer version minus the sample's policy version
    dropped: int  # samples dropped as too stale when the batch was assembled


class RunService:
    def __init__(
        self, manifest: RunManifest, run_key: Ed25519PrivateKey, task: Task, render_prompt: Callable[[int], tuple[int, ...]],
        transcripts: Transcripts, ledger: Ledger, lease_seconds: float, seeds_per_lease: int,
        policing: Policing, relay: Relay | None = None, first_seed: int = 0, max_ahead: int | None = None,
        evaluation: EvalSet | None = None, eval_task: Task | None = None,
    ):
        self.manifest, self.run_key, self.task, self.ledger = manifest, run_key, task, ledger
        self.journal = Journal(ledger)
        self.eval_task = eval_task or task  # the run's task, maybe with other parameters
        self.policing = policing
        self.lease_rate = RateLimit(LEASE_RATE.rate, LEASE_RATE.burst)
        self._draws = random.SystemRandom()  # spot-check draws: a node must not predict them
        self.render_prompt, self.transcripts = render_prompt, transcripts
        self.mode = Mode(manifest.mode)
        # Lease ids must never repeat across restarts (the gate remembers accepted ones): evaluation
        # books get a fresh prefix each start; the training book is restored, counter and all.
        self.lease_prefix = f"{secrets.token_hex(3)}-"
        self.book = LeaseBook(ttl=lease_seconds, id_prefix=self.lease_prefix)
        self.gate = RolloutGate(self.mode, manifest.staleness, version=0)
        # Sequential mode trains only on the requested version: a replay bound of 0.
        self.replay = ReplayBuffer(manifest.staleness if self.mode is Mode.ASYNC else 0)
        self.seeds_per_lease = seeds_per_lease
        # Async: buffered groups at which no lease is issued until the trainer takes some (None =
        # no cap). Over-producing nodes would otherwise fill the buffer, and the trainer, taking
        # the oldest groups first, would train S versions behind all the time. Leases out do not
        # count, so a straggler holding one never stops the others.
        self.max_ahead = max_ahead
        self.next_seed = first_seed  # async mode draws fresh seeds from here as leases drain them
        self.lock = threading.Lock()  # handlers run on the transport's loop, the step loop elsewhere
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.relay = relay or Relay()  # serves published updates (manifests, index, chunks) to nodes
        self.started = False  # no work is handed out before the step loop starts (min_nodes reached)
        self.training = True  # false once the last step is taken: only evaluation work is left
        self.evaluation = evaluation
        self.evals: list[EvalRound] = []  # open evaluation rounds, oldest first
        self.eval_records: list[dict] = []  # finished (or given up) rounds, for the step loop to log
        self.finished = False
        self.told_finished: set[str] = set()  # nodes that have heard the run is over
        self.names: dict[str, str] = {}  # node id -> display name from its (signed) lease requests
        self.last_seen: dict[str, float] = {}  # node id -> time of its last signed lease request
        self.backends: dict[str, str] = {}  # node id -> backend it says it samples with (display only)
        self.hardware: dict[str, str] = {}  # node id -> its announcement's hardware summary (display only)
        self.announced: frozenset[str] = frozenset()  # node ids with a live announcement in the DHT
        self.throughput = Throughput()  # measured rollout throughput per node (the capacity model's μ_i)
        self._streams: dict[str, str] = {}  # node id -> libp2p peer its last lease request came from
        self._judging: set[tuple[str, str]] = set()  # (lease id, signer) of batches being judged now
        self.rejections: Counter[str] = Counter()
        self.unsigned: Counter[str] = Counter()  # pushes refused before a key could be named (since start)
        self._dropped = 0  # samples dropped from the buffer as stale since the last take_batch

    @property
    def version(self) -> int:
        return self.gate.version

    # -- driven by the step loop -------------------------------------------------------------

    def open_step(self, seeds: list[int]) -> None:
        """Sequential mode: lease exactly these seeds at the current version (after a restart,
        those the restored book and buffer do not already hold)."""
        with self.lock:
            buffered = {entry.item.seed for entry in self.replay}
            self._add_seeds([s for s in seeds if not self.book.knows(s) and s not in buffered])
            saved = self.journal.save(self._book_state())
        saved.result()

    def _book_state(self) -> dict:
        """Under the lock: the training leases, for the journal."""
        return {"leases": self.book.to_dict(), "next_seed": self.next_seed}

    def _add_seeds(self, seeds: list[int]) -> None:
        for seed in seeds:
            self.prompts[seed] = self.render_prompt(seed)
        self.book.add_seeds(seeds)

    def step_done(self, now: float) -> bool:
        """Sequential mode: every seed of the step has been answered."""
        with self.lock:
            self.book.expire(now)
            return self.book.pending_count == 0 and not self.book.outstanding

    def buffered_groups(self) -> int:
        with self.lock:
            dropped = self.replay.prune(self.version)
            saved = self._drop(dropped) if dropped else None
            count = len(self.replay)
        if saved:
            saved.result()
        return count

    def take_batch(self, groups: int | None = None) -> StepBatch:
        """Take up to `groups` groups (all if None) that the staleness bound still admits, for
        the step from the current version. Their nodes are credited by `commit_step`, once the
        step is saved: a group that goes stale in the buffer, or whose step dies in a crash, is
        not credited (the latter is trained on again after the restart)."""
        with self.lock:
            taken, dropped = self.replay.take(len(self.replay) if groups is None else groups, self.version)
            saved = self._drop(dropped, taken=taken)
            batch = StepBatch([], [], [], self._dropped)
            self._dropped = 0
            for entry in taken:
                staleness = self.version - entry.version
                batch.samples += [dataclasses.replace(s, staleness=staleness) for s in entry.item.samples]
                batch.rewards += [s.reward for s in entry.item.samples]
                batch.staleness += [staleness] * len(entry.item.samples)
        saved.result()
        return batch

    def commit_step(self, version: int) -> None:
        """The step from `version` is checkpointed: credit the groups it trained on."""
        self.journal.commit_step(version).result()

    def _drop(self, dropped, taken=()):
        """Under the lock: count groups dropped as too stale; journal them with those `taken`."""
        for entry in dropped:
            self._dropped += len(entry.item.samples)
            self.rejections["stale"] += len(entry.item.samples)
        return self.journal.take([e.item for e in taken], self.version, [e.item for e in dropped])

    def publish(self, updates: list[tuple[WeightUpdate, dict[str, bytes]]]) -> None:
        """Serve `updates` (all ending at one new version: a delta and maybe a snapshot) and make
        that version current."""
        with self.lock:
            for update, chunks in updates:
                self.relay.remember(update, chunks)
            if self.relay.latest_version > self.gate.version:
                self.gate.advance(self.relay.latest_version)
            self.throughput.published_version(self.gate.version, time.time())

    def open_eval(self, version: int, weights: dict | None, now: float | None = None) -> None:
        """Evaluate `version` (`weights`: what nodes hold at it, for verification)."""
        now = time.time() if now is None else now
        ev = self.evaluation
        with self.lock:
            for sampling in ev.samplings:
                greedy = sampling == "greedy"
                book = LeaseBook(ttl=self.book.ttl, id_prefix=f"{self.lease_prefix}e{version}{sampling[0]}-")
                book.add_seeds(ev.prompts)
                self.evals.append(EvalRound(version, greedy, 1 if greedy else ev.samples, book, weights, now))
            while len(self.evals) > MAX_OPEN_EVALS:
                self.eval_records.append(self.evals.pop(0).record(now))

    def take_eval_records(self, give_up: bool = False, now: float | None = None) -> list[dict]:
        """Finished evaluation rounds since the last call; `give_up`: end the open ones too, as they stand."""
        now = time.time() if now is None else now
        with self.lock:
            if give_up:
                self.eval_records += [r.record(now) for r in self.evals]
                self.evals = []
            records, self.eval_records = self.eval_records, []
            return records

    def evaluating(self) -> bool:
        with self.lock:
            return bool(self.evals)

    def state(self) -> dict:
        """What `state.json` keeps of the service besides the version: the gate's counters. (Its
        accepted lease ids are in the journal, written as they are accepted: a file rewritten
        each step must not grow with the run.)"""
        with self.lock:
            return {"gate": {**self.gate.to_dict(), "accepted_keys": []}}

    def restore(self, state: dict, version: int) -> None:
        """After a restart at `version` (the checkpoint's): the gate, and from the journal every
        accepted group not yet trained on and the training leases, so the staleness bound and
        single-use leases hold across the restart (cf. AReaL #1388) and nodes push what they hold."""
        recovered = self.journal.recover(version)
        with self.lock:
            self.gate = RolloutGate.from_dict({**state["gate"], "version": version,
                                               "accepted_keys": sorted(recovered.accepted)})
            for group in recovered.groups:
                self.replay.add(group.node_id, group.version, group)
            if "leases" in recovered.values:
                book = LeaseBook.from_dict(recovered.values["leases"])
                book.ttl = self.book.ttl  # this start's setting, for the leases it issues
                self.book = book
                self.next_seed = int(recovered.values["next_seed"])
                for seed in book.pending_seeds + tuple(s for lease in book.outstanding for s in lease.seeds):
                    self.prompts[seed] = self.render_prompt(seed)

    def all_told_finished(self) -> bool:
        """Every node that asked for work since this start, and every node announcing itself in the
        run (one that has not asked since a restart may be waiting out a retry delay), has heard."""
        with self.lock:
            return set(self.names) | self.announced <= self.told_finished

    def prune(self, now: float, idle: float = 600.0) -> None:
        """Forget keys that have not asked for work in `idle` seconds (names, rate buckets): keys
        are free, so what the service keeps per key must not grow with every key ever seen."""
        with self.lock:
            for node_id in [n for n, at in self.last_seen.items() if now - at > idle]:
                del self.last_seen[node_id]
                self.names.pop(node_id, None)
                self.backends.pop(node_id, None)
                self.throughput.forget(node_id)
                self._streams.pop(node_id, None)
                self.told_finished.discard(node_id)
            self.lease_rate.forget_idle(now)

    # -- handlers ------------------------------------------------------------------------------

    def expired_leases(self) -> int:
        """Training leases that expired unanswered since this start (their seeds were leased again)."""
        with self.lock:
            return self.book.expired_count

    def rejection_counts(self) -> Counter[str]:
        """Samples refused so far, by reason (a copy: handler threads keep counting)."""
        with self.lock:
            return Counter(self.rejections)

    def live(self, now: float) -> dict:
        """What only the running process knows, for the dashboard: run state and, per node seen in
        the last `prune` window, its backend, held version and measured throughput."""
        with self.lock:
            rates = self.throughput.rates(now)
            nodes = {n: dict(name=self.names.get(n, n[:8]), backend=self.backends.get(n, ""),
                             hardware=self.hardware.get(n, ""), holds=self.throughput.held.get(n),
                             samples_per_second=rates.get(n), last_request=at)
                     for n, at in self.last_seen.items()}
            return dict(started=self.started, finished=self.finished, version=self.version,
                        buffered_groups=len(self.replay), outstanding_leases=len(self.book.outstanding),
                        update_seconds=self.throughput.update_seconds(), nodes=nodes, unsigned=dict(self.unsigned))

    def talked(self) -> dict[str, str]:
        """Node id -> the libp2p peer it asked for work from: proof that an announcement is live."""
        with self.lock:
            return dict(self._streams)

    def handle_lease(self, request: LeaseRequest, peer_id: str = "", now: float | None = None) -> TaskLease | NoWork:
        """`peer_id`: the libp2p peer the request came from (the transport's word, not the request's)."""
        now = time.time() if now is None else now
        verify_message(request, request.node_key)
        if request.run_id != self.manifest.run_id:
            raise InvalidValue(f"lease request for run {request.run_id!r}, this is {self.manifest.run_id!r}")
        if abs(now - request.time) > REQUEST_MAX_AGE:
            raise InvalidValue(f"lease request time is {now - request.time:.0f} s off; check the node's clock")
        node_id = request.node_id
        self._admit(node_id, now)
        with self.lock:
            if not self.lease_rate.allow(node_id, now):
                raise PeerRefused("rate_limited", f"more than {LEASE_RATE.rate:g} lease requests a second")
            self.names[node_id], self.last_seen[node_id] = request.name, now
            self.backends[node_id] = request.backend
            self.throughput.holds(node_id, request.version, now)
            if peer_id:
                self._streams[node_id] = peer_id
            if self.finished:
                self.told_finished.add(node_id)
                return NoWork(self.version, RETRY_AFTER, finished=True)
            books = [self.book] + [r.book for r in self.evals]
            for book in books:
                book.expire(now)  # an expired lease no longer counts against its key
            held = sum(lease.node_id == node_id for book in books for lease in book.outstanding)
            if held >= MAX_LEASES_PER_KEY:
                raise PeerRefused("lease_limit", f"this key already holds {held} leases; push or let them expire")
            if not self.started:
                return NoWork(self.version, RETRY_AFTER)
            count = min(request.max_seeds, self.seeds_per_lease)
            # Async nodes are never idle, so evaluation goes first; sequential nodes are idle
            # while the trainer steps, and evaluate then. Either way a node that holds an open
            # round's version answers it before training work moves it on: then it no longer can.
            holds_round = any(r.version == request.version and r.book.pending_count for r in self.evals)
            if self.mode is Mode.ASYNC or (holds_round and request.version < self.version):
                work = self._eval_lease(node_id, request, now) or self._train_lease(node_id, count, now)
            else:
                work = self._train_lease(node_id, count, now) or self._eval_lease(node_id, request, now)
            if work is None:
                return NoWork(self.version, RETRY_AFTER)
            saved = None if work.evaluation else self.journal.save(self._book_state())
        if saved:
            saved.result()  # a training lease is in the journal before the node has it
        return work

    def _train_lease(self, node_id: str, count: int, now: float) -> TaskLease | None:
        if not self.training:
            return None
        if self.mode is Mode.ASYNC and self.max_ahead is not None and len(self.replay) >= self.max_ahead:
            return None
        if self.mode is Mode.ASYNC and self.book.pending_count < count:
            fresh = list(range(self.next_seed, self.next_seed + count))
            self.next_seed += count
            self._add_seeds(fresh)
        lease = self.book.issue(node_id, count, self.version, now)
        if lease is None:
            return None
        return TaskLease(
            lease_id=lease.lease_id, run_id=self.manifest.run_id, node_id=lease.node_id, seeds=lease.seeds,
            prompts=tuple(self.prompts[s] for s in lease.seeds), version=lease.version, expires_at=lease.expires_at,
        )

    def _eval_lease(self, node_id: str, request: LeaseRequest, now: float) -> TaskLease | None:
        """Seeds of the oldest open evaluation round this node can answer: it must hold the
        round's version or an older one (nodes move forward, never back)."""
        for r in self.evals:
            if request.version > r.version:
                continue
            # About a training lease's worth of completions.
            count = min(request.max_seeds, max(1, self.seeds_per_lease * self.manifest.group_size // r.samples))
            lease = r.book.issue(node_id, count, r.version, now)
            if lease is not None:
                return TaskLease(
                    lease_id=lease.lease_id, run_id=self.manifest.run_id, node_id=node_id, seeds=lease.seeds,
                    prompts=tuple(self.evaluation.prompts[s] for s in lease.seeds), version=r.version,
                    expires_at=lease.expires_at, evaluation=True, samples=r.samples, greedy=r.greedy,
                )
        return None

    def _admit(self, node_id: str, now: float) -> None:
        """Refuse a key that is not on the allow-list or is serving a ban."""
        allow = self.policing.allow
        if allow is not None and node_id not in allow:
            raise PeerRefused("not_allowed", f"key {node_id} is not on this run's allow-list")
        banned_until = self.ledger.trust(node_id).banned_until
        if banned_until > now:
            raise PeerRefused("banned", f"key {node_id} failed verification; banned for {banned_until - now:.0f} s more")

    def handle_push(self, data: bytes, peer_id: str, now: float | None = None) -> PushReceipt:
        """Judge a pushed batch (wire bytes) and buffer its groups. Credit comes later, when a step
        trains on them."""
        now = time.time() if now is None else now
        try:
            node_id, body = RolloutBatch.signed_body(data)
        except ProtocolError as e:
            # Whoever sent it cannot be named: no ledger row changes, not even the claimed key's.
            with self.lock:
                self.rejections[e.code] += 1
                self.unsigned[e.code] += 1
            raise
        name = self.names.get(node_id, node_id[:8])
        samples = 1  # what a batch that does not even decode is counted as
        try:
            batch = RolloutBatch.from_dict(body)
            samples = len(batch.samples)
            saved = self._accept(batch, peer_id, name, now)
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
        return PushReceipt(accepted=len(batch.samples), rejected=0, latest_version=self.version)

    def _accept(self, batch: RolloutBatch, peer_id: str, name: str, now: float):
        """Judge a batch and buffer its groups; returns the journal write to wait for (None for
        an evaluation answer: scored, nothing to train on)."""
        if batch.run_id != self.manifest.run_id:
            raise InvalidValue(f"batch for run {batch.run_id!r}, this is {self.manifest.run_id!r}")
        self._admit(batch.node_id, now)
        started = time.monotonic()
        judging = (batch.lease_id, batch.node_id)  # keyed by signer too: nobody can block another's push
        with self.lock:
            if judging in self._judging:
                # The same lease pushed again (from any number of peers) while we judge it: one
                # replay and one verification per lease, never more.
                raise LeaseError(f"lease {batch.lease_id} is already being judged")
            self._judging.add(judging)
            round_ = self._round_of(batch.lease_id)
        book = self.book if round_ is None else round_.book
        try:
            with self.lock:
                lease = self._held_lease(batch, now, round_)
                prompts = {seed: (self.prompts if round_ is None else self.evaluation.prompts)[seed] for seed in lease.seeds}
            # Judged without the lock: replay and verification take a while, other handlers go on.
            self._check_samples(batch, prompts, self.manifest.group_size if round_ is None else round_.samples)
            # Rewards are recomputed here by replaying each episode; nothing the node says counts.
            task = self.task if round_ is None else self.eval_task
            rewards = [score(task, s, self.transcripts) for s in batch.samples]
            self._verify(batch, now, round_)
            now += time.monotonic() - started  # the lease may have expired while we judged
            groups = [] if round_ is not None else self._groups(batch, rewards, peer_id, name)
            with self.lock:
                self._held_lease(batch, now, round_)
                if round_ is None:
                    self._offer(batch)
                book.complete(batch.lease_id, batch.node_id, now)
                self.throughput.pushed(batch.node_id, len(batch.samples), lease.expires_at - self.book.ttl, now)
                if round_ is not None:
                    self._answered(round_, batch, rewards, now)
                    return None
                for group in groups:
                    self.prompts.pop(group.seed, None)  # answered: never leased again
                    self.replay.add(group.node_id, group.version, group)
                return self.journal.accept(batch.lease_id, groups, self._book_state())
        except ProtocolError:
            # The holder's (signed) attempt failed: its seeds go straight back to other nodes.
            with self.lock:
                if any(x.lease_id == batch.lease_id and x.node_id == batch.node_id for x in book.outstanding):
                    book.release(batch.lease_id, batch.node_id)
            raise
        finally:
            with self.lock:
                self._judging.discard(judging)

    @staticmethod
    def _groups(batch: RolloutBatch, rewards: list[float], peer_id: str, name: str) -> list[Group]:
        """A judged batch as GRPO groups, one per seed, with the rewards we computed."""
        by_seed: dict[int, list[TrainSample]] = {}
        for s, reward in zip(batch.samples, rewards):
            by_seed.setdefault(s.seed, []).append(
                TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, reward, s.seed))
        return [Group(batch.lease_id, seed, batch.version, tuple(samples), batch.node_id, peer_id, name,
                      tokens=sum(sum(s.loss_mask) for s in samples))  # generated by the node, not env turns
                for seed, samples in by_seed.items()]

    def _answered(self, round_: EvalRound, batch: RolloutBatch, rewards: list[float], now: float) -> None:
        """Under the lock: record an accepted evaluation batch; log the round once it is complete."""
        for s, reward in zip(batch.samples, rewards):
            round_.rewards.setdefault(s.seed, []).append(reward)
        round_.tokens += sum(sum(s.loss_mask) for s in batch.samples)
        if round_.done() and round_ in self.evals:
            self.evals.remove(round_)
            self.eval_records.append(round_.record(now))

    def _round_of(self, lease_id: str) -> EvalRound | None:
        """The open evaluation round a lease id belongs to (None: a training lease, or no open round)."""
        return next((r for r in self.evals if lease_id.startswith(r.book.prefix)), None)

    def _held_lease(self, batch: RolloutBatch, now: float, round_: EvalRound | None) -> Lease:
        """The outstanding lease this batch answers (in `round_`'s book for an evaluation), held by
        its signer, admitting its version."""
        book = self.book if round_ is None else round_.book
        book.expire(now)
        lease = next((x for x in book.outstanding if x.lease_id == batch.lease_id), None)
        if lease is None:
            book.complete(batch.lease_id, batch.node_id, now)  # raises the precise LeaseError
            raise LeaseError(f"lease {batch.lease_id} is not outstanding")
        if lease.node_id != batch.node_id:
            raise LeaseError(f"lease {batch.lease_id} belongs to another node")
        if round_ is not None:
            if batch.version != round_.version:  # an evaluation is of exactly one version
                verdict = Verdict.FUTURE if batch.version > round_.version else Verdict.WRONG_VERSION
                raise Refused(verdict, f"{verdict.value}: evaluation lease of version {round_.version}, "
                                       f"batch claims version {batch.version}")
            return lease
        if not lease_admits(self.mode, self.manifest.staleness, lease.version, batch.version):
            verdict = Verdict.FUTURE if batch.version > lease.version else Verdict.WRONG_VERSION
            raise Refused(verdict, f"{verdict.value}: batch claims version {batch.version}; its lease of version {lease.version} "
                                   f"admits {'only that' if self.mode is Mode.SEQUENTIAL else 'the S versions up to it'}")
        if judge_version(self.mode, self.version, self.manifest.staleness, batch.version) is not Verdict.ACCEPT:
            self._offer(batch)  # already too old (or early): refuse now, before paying for replay and verification
        return lease

    def _offer(self, batch: RolloutBatch) -> None:
        """The rollout gate's verdict, counted; accepted batches are remembered for good."""
        verdict = self.gate.offer(batch.node_id, batch.lease_id, batch.version)
        if verdict is not Verdict.ACCEPT:
            raise Refused(verdict, f"batch of version {batch.version} refused at version {self.version}: {verdict.value}")

    def _verify(self, batch: RolloutBatch, now: float, round_: EvalRound | None = None) -> None:
        """Check the sampling if the spot-check says so; a failure is a strike and a ban. An
        evaluation batch is always checked, against its round's weights, greedy or with the lease's noise."""
        verifier = self.policing.verifier
        if verifier is None:
            return
        trust = self.ledger.trust(batch.node_id)
        # Every evaluation batch is checked: held-out accuracy is the number a run is judged by,
        # and its batches are small (a lease of greedy answers).
        if round_ is None and not self.policing.spot.should_check(trust.verified, trust.failed, self._draws.random()):
            return
        try:
            if round_ is None:
                verifier.check(batch.lease_id, batch.version, batch.samples)
            else:
                verifier.check(batch.lease_id, batch.version, batch.samples, round_.weights, round_.greedy)
        except VerificationError as e:
            if e.code != "unverifiable":
                self.ledger.record_check(batch.node_id, False, self.policing.bans.seconds, now)
            raise
        self.ledger.record_check(batch.node_id, True, self.policing.bans.seconds, now)

    def _check_samples(self, batch: RolloutBatch, prompts: dict[int, tuple[int, ...]], group: int) -> None:
        batch.check_vocab(self.manifest.vocab_size)
        per_seed = Counter(s.seed for s in batch.samples)
        if set(per_seed) != set(prompts) or any(n != group for n in per_seed.values()):
            raise InvalidValue(f"batch must hold {group} samples for each leased seed {sorted(prompts)}, got {dict(per_seed)}")
        for s in batch.samples:
            if s.prompt_ids != prompts[s.seed]:
                raise InvalidValue(f"sample for seed {s.seed} does not use the leased prompt")

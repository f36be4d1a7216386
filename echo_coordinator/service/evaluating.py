"""The service's open evaluation rounds (`echo_coordinator.evaluation` says what a round is): their
lease books, the answers they are scored with, and the records of finished rounds for the step
loop to log. Evaluation leases take the push path of training leases to a different end:
scored for held-out accuracy, credited at once, never trained on.
"""

from __future__ import annotations

from echo_coordinator.evaluation import EvalRound, EvalSet
from protocols.messages import LeaseRequest, RolloutBatch, TaskLease
from protocols.leases import LeaseBook

MAX_OPEN_EVALS = 4  # evaluation rounds open at once; opening another gives up the oldest


class EvalRounds:
    """The open rounds, oldest first. No lock of its own: the service's lock guards it."""

    def __init__(self, evaluation: EvalSet | None, run_id: str, lease_seconds: float, id_prefix: str,
                 completions_per_lease: int):
        self.evaluation = evaluation
        self.run_id = run_id
        self.lease_seconds = lease_seconds
        self.id_prefix = id_prefix  # this start's: a round's lease ids must never repeat across restarts
        self.completions_per_lease = completions_per_lease  # a training lease's worth
        self.open: list[EvalRound] = []
        self.records: list[dict] = []  # finished (or given up) rounds, for the step loop to log

    def start(self, version: int, weights: dict | None, now: float) -> None:
        """Evaluate `version` (`weights`: what nodes hold at it, for verification)."""
        ev = self.evaluation
        for sampling in ev.samplings:
            greedy = sampling == "greedy"
            book = LeaseBook(ttl=self.lease_seconds, id_prefix=f"{self.id_prefix}e{version}{sampling[0]}-")
            book.add_seeds(ev.prompts)
            self.open.append(EvalRound(version, greedy, 1 if greedy else ev.samples, book, weights, now))
        while len(self.open) > MAX_OPEN_EVALS:
            self.records.append(self.open.pop(0).record(now))

    def take_records(self, give_up: bool, now: float) -> list[dict]:
        """Finished rounds since the last call; `give_up`: end the open ones too, as they stand."""
        if give_up:
            self.records += [r.record(now) for r in self.open]
            self.open = []
        records, self.records = self.records, []
        return records

    def books(self) -> list[LeaseBook]:
        return [r.book for r in self.open]

    def pending_at(self, version: int) -> bool:
        """Is a round of `version` still waiting for seeds to be leased?"""
        return any(r.version == version and r.book.pending_count for r in self.open)

    def lease(self, node_id: str, request: LeaseRequest, now: float, proven: bool = False) -> TaskLease | None:
        """Seeds of the oldest open evaluation round this node can answer: it must hold the
        round's version or an older one (nodes move forward, never back). About a training
        lease's worth of completions, or for a `proven` key (`leasing.training_seeds`) enough
        to fill its batch."""
        for r in self.open:
            if request.version > r.version:
                continue
            completions = max(self.completions_per_lease, request.parallel if proven else 0)
            count = min(request.max_seeds, max(1, completions // r.samples))
            lease = r.book.issue(node_id, count, r.version, now)
            if lease is not None:
                return TaskLease(
                    lease_id=lease.lease_id, run_id=self.run_id, node_id=node_id, seeds=lease.seeds,
                    prompts=tuple(self.evaluation.prompts[s] for s in lease.seeds), version=r.version,
                    expires_at=lease.expires_at, evaluation=True, samples=r.samples, greedy=r.greedy,
                    noise=r.noise_id,
                )
        return None

    def round_of(self, lease_id: str) -> EvalRound | None:
        """The open evaluation round a lease id belongs to (None: a training lease, or no open round)."""
        return next((r for r in self.open if lease_id.startswith(r.book.prefix)), None)

    def answered(self, round_: EvalRound, batch: RolloutBatch, rewards: list[float], now: float) -> None:
        """Record an accepted evaluation batch; log the round once it is complete."""
        for s, reward in zip(batch.samples, rewards):
            round_.rewards.setdefault(s.seed, []).append(reward)
        round_.tokens += sum(sum(s.loss_mask) for s in batch.samples)
        if round_.done() and round_ in self.open:
            self.open.remove(round_)
            self.records.append(round_.record(now))

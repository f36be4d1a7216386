"""Peer policing: who may ask for work, how often, which batches are verified, and for how long a
cheat is shut out.

The rules (`RateLimit`, `relay_holders` here, the trust rule in `echo_coordinator.trust`) are pure
decision logic (no clock, no I/O); `Policing` applies them for the service, and the ledger keeps
what must survive a restart (each key's trust record). Keys are free, so none of this stops a
Sybil with many keys; it bounds what each key costs us and makes a caught key worthless for a
growing time.
docs/verification.md says what stays open and what an operator can do (`--allow-keys`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from echo_coordinator.evaluation import EvalRound
from echo_coordinator.ledger import Ledger
from echo_coordinator.trust import BanRule, OutlierBudget, SpotCheck, Trust, judged, struck
from echo_coordinator.verify import Verifier
from protocols.errors import PeerRefused, VerificationError
from protocols.messages import RolloutBatch
from protocols.sampling import TRAINING_NOISE
from protocols.signing import FINGERPRINT_CHARS

_DRAWS = random.SystemRandom()  # spot-check draws: a node must not predict them


@dataclass
class RateLimit:
    """A token bucket per peer: `rate` requests a second on average, bursts up to `burst`."""

    rate: float
    burst: float
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (tokens, at)

    def allow(self, peer: str, now: float) -> bool:
        tokens, at = self._buckets.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        return allowed

    def forget_idle(self, now: float) -> None:
        """Drop full buckets (peers quiet long enough to be back at `burst`): bounded memory."""
        self._buckets = {p: (t, at) for p, (t, at) in self._buckets.items()
                         if t + (now - at) * self.rate < self.burst}


@dataclass(frozen=True)
class Policing:
    """How the service polices peers: verification, spot checks, bans, the allow-list."""

    verifier: Verifier | None  # None: sampling is not verified (tests of other rules only)
    spot: SpotCheck = SpotCheck()
    bans: BanRule = BanRule()
    allow: frozenset[str] | None = None  # node key fingerprints; None = anyone may join
    outliers: OutlierBudget = OutlierBudget()
    # The step can verify a batch of its own version from its own forward (LoRA, one trainer
    # process: `trainer.step_checks`), at next to no cost: such batches wait for it, from keys
    # with `in_step_after` verified batches and no failed one.
    in_step: bool = False
    in_step_after: int = 1

    def admit(self, ledger: Ledger, node_id: str, now: float) -> Trust:
        """Refuse a key that is not on the allow-list or is serving a ban; else its trust record."""
        if self.allow is not None and node_id not in self.allow:
            raise PeerRefused("not_allowed", f"key {node_id} is not on this run's allow-list")
        trust = ledger.trust(node_id)
        if trust.banned(now):
            raise PeerRefused("banned", f"key {node_id} failed verification; banned for "
                                        f"{trust.banned_until - now:.0f} s more")
        return trust

    def verify(self, ledger: Ledger, batch: RolloutBatch, now: float, round_: EvalRound | None = None,
               current: int | None = None) -> bool:
        """Check the sampling if the spot-check says so; a failure is a strike and a ban. An
        evaluation batch is always checked, against its round's weights, greedy or with the lease's noise.
        True: the check waits for the step (`in_step`; `current`: the trainer's version now), which
        then checks every batch of a trusted key of that version, spot-check or not."""
        if self.verifier is None:
            return False
        trust = ledger.trust(batch.node_id)
        # A new key, or one that ever failed, is checked now: a batch the step refuses leaves the
        # step smaller (its seeds were not leased again), so a key must have had verified work
        # trained before it can cost a step that, once: it is banned then.
        if self.in_step and round_ is None and batch.version == current and trust.proven(self.in_step_after):
            return True
        # Every evaluation batch is checked: held-out accuracy is the number a run is judged by,
        # and its batches are small (a lease of greedy answers).
        if round_ is None and not self.spot.should_check(trust, _DRAWS.random()):
            return False
        # A new key's batch waits for the trainer's other work: keys are free, and a fresh one can
        # push a lease of random tokens at once (issue 36 point 3).
        behind = trust.new
        try:
            if round_ is None:
                self.verifier.check(TRAINING_NOISE, batch.version, batch.samples, behind=behind)
            else:
                self.verifier.check(round_.noise_id or batch.lease_id, batch.version, batch.samples, round_.weights,
                                    round_.greedy, behind=behind)
        except VerificationError as e:
            self.settle(ledger, batch.node_id, e.code, len(batch.samples), now)
            raise
        self.settle(ledger, batch.node_id, None, len(batch.samples), now)
        return False

    def settle(self, ledger: Ledger, node_id: str, reason: str | None, samples: int, now: float) -> None:
        """What a verdict on a key's batch of `samples` means for the key (`trust.judged`)."""
        ledger.update_trust(node_id, lambda t: judged(t, reason, samples, self.bans, self.outliers, now))

    def strike(self, ledger: Ledger, node_id: str, now: float) -> None:
        """A cheat caught (a failed verification, a truncated sample): a strike and a ban."""
        ledger.update_trust(node_id, lambda t: struck(t, self.bans, now))


def relay_holders(talked: dict[str, str], held: dict[str, int], latest: int) -> dict[str, int]:
    """libp2p peer -> version it holds: per node key, the peer its lease requests came from
    (`talked`, authenticated by the transport) and the version they said it holds (`held`), when
    that is no version past `latest`, the newest published. A claim of a version that exists is
    still only a claim: the upload budget's `patience` bounds what one costs the honest nodes it
    turns away to fetch from the claimant.
    (This was read from the DHT's peers record, whose cost grows with the swarm: docs/scaling.md.)"""
    return {peer: held[n] for n, peer in talked.items() if n in held and held[n] <= latest}


def read_allow_list(path: Path) -> frozenset[str]:
    """Node key fingerprints, one per line (`#` comments and blank lines ignored)."""
    keys = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if len(line) != FINGERPRINT_CHARS or not line.isalnum():
            raise ValueError(f"{path}:{number}: {line!r} is not a {FINGERPRINT_CHARS}-character key fingerprint")
        keys.add(line.lower())
    return frozenset(keys)

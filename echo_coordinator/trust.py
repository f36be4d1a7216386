"""The trust rule, in one place: what each verdict on a key's batch does to the key's record, when
a key is banned, when its batches are checked. Pure functions over `Trust` (no clock, no I/O);
the ledger only stores the record (`Ledger.update_trust`) and `service.policing` applies the rule.

- A batch that fails verification, or cuts honest tokens short, is a strike; strike k bans the
  key for `BanRule.first * 2**(k-1)` seconds, at most a day (`struck`).
- A lone outlier (one written or unlucky token, `protocols.sampling.judge`) is refused, and a
  strike only past the key's `OutlierBudget` (`outlier`).
- A new key's batches, and every batch of a key that ever failed, are checked; past that a
  `SpotCheck.fraction` of them (1 by default: nothing is trained on unverified). Where the step
  checks batches itself, a proven key's wait for it (`Trust.proven`, `service.policing`).
Keys are free, so none of this stops a Sybil with many keys: it bounds what each key costs and
makes a caught key worthless for a growing time (docs/verification.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Trust:
    """A key's record: batches verified (and their samples), strikes, lone outliers, ban."""

    verified: int = 0
    failed: int = 0  # strikes
    banned_until: float = 0.0  # unix seconds
    samples: int = 0  # in verified batches
    outliers: int = 0  # batches refused for a lone outlier

    def banned(self, now: float) -> bool:
        return self.banned_until > now

    def proven(self, batches: int) -> bool:
        """At least `batches` batches verified and never a strike."""
        return self.failed == 0 and self.verified >= batches

    @property
    def new(self) -> bool:
        """No batch of it verified yet: its batches are always checked, behind the trainer's work."""
        return self.verified == 0


@dataclass(frozen=True)
class BanRule:
    """Strike k bans the key for `first * 2**(k-1)` seconds, at most `longest`. An honest node's
    false-rejection rate is measured to be 0 (docs/verification.md), so one strike already shuts
    a key out briefly."""

    first: float = 60.0
    longest: float = 24 * 3600.0

    def seconds(self, strikes: int) -> float:
        return min(self.first * 2.0 ** max(strikes - 1, 0), self.longest) if strikes > 0 else 0.0


@dataclass(frozen=True)
class SpotCheck:
    """Which batches get their sampling verified. Every batch of a key that is new (fewer than
    `trust_after` verified batches) or has ever failed; past that, a `fraction` of batches at
    random. A cheat in k batches of a trusted key goes unseen with probability (1 - fraction)**k."""

    fraction: float = 1.0
    trust_after: int = 4

    def __post_init__(self):
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"spot-check fraction must be in (0, 1], got {self.fraction}")

    def should_check(self, trust: Trust, draw: float) -> bool:
        """`draw`: a uniform [0, 1) number the caller drew (secret from the node)."""
        return not trust.proven(self.trust_after) or draw < self.fraction


@dataclass(frozen=True)
class OutlierBudget:
    """How many lone outliers a key may show before one is a strike: `first`, and one more per
    `every` samples of its verified batches. Honest nodes made 4 in 20,512 calibration samples
    (docs/verification.md), so the budget runs five times ahead of them: 4 outliers in an honest
    key's first 1,000 samples (Poisson, mean 0.2) happen about 5 times in 100,000 keys, later on
    less. A key that writes answers is struck from its fourth, and no outlier batch is ever
    accepted, so writing earns nothing."""

    first: int = 3
    every: int = 1000

    def strikes(self, verified_samples: int, outliers: int) -> bool:
        """Whether a key's `outliers`-th lone outlier, after `verified_samples`, is a strike."""
        return outliers > self.first + verified_samples // self.every


def verified(trust: Trust, samples: int) -> Trust:
    """A batch of `samples` passed verification. A ban being served stands."""
    return dataclasses.replace(trust, verified=trust.verified + 1, samples=trust.samples + samples)


def struck(trust: Trust, bans: BanRule, now: float) -> Trust:
    """A cheat caught: one more strike, banned from `now` for its length (never shortening a ban)."""
    return dataclasses.replace(trust, failed=trust.failed + 1,
                               banned_until=max(trust.banned_until, now + bans.seconds(trust.failed + 1)))


def outlier(trust: Trust, budget: OutlierBudget, bans: BanRule, now: float) -> Trust:
    """A batch refused for a lone outlier: counted, and a strike past the key's budget."""
    counted = dataclasses.replace(trust, outliers=trust.outliers + 1)
    return struck(counted, bans, now) if budget.strikes(counted.samples, counted.outliers) else counted


def judged(trust: Trust, reason: str | None, samples: int, bans: BanRule, budget: OutlierBudget,
           now: float) -> Trust:
    """The record after a verdict on a batch of `samples`: None, it passed; "outlier", `outlier`;
    "unverifiable" (the trainer could not check it: no fault of the key) changes nothing; any
    other reason is a strike."""
    if reason is None:
        return verified(trust, samples)
    if reason == "outlier":
        return outlier(trust, budget, bans, now)
    if reason == "unverifiable":
        return trust
    return struck(trust, bans, now)

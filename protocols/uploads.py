"""How much a relay uploads (pure policy; the relay acts on it): the trainer's share of each
update (`UploadBudget`), and a volunteer's bytes in all (`ByteQuota`).

Nodes that verified an update serve it to others, so the trainer need send only a few copies.
It hands each update whole to the first `copies` nodes that ask (a whole copy, so that node can
relay it soon) and answers later askers "busy" while some peer says it holds the update (in its
lease requests): they fetch from peers. While nobody does (the first downloaders are still at
it, or left), one more node is let in every `grace` seconds, so distribution never stalls. And
an asker turned away for `patience` seconds is let in whatever peers say: holding is only a
claim, and peers that claim an update and never serve it must not stall the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field


MAX_WAITING = 10_000  # askers an account remembers being turned away (the oldest forgotten first)


@dataclass
class _Account:
    admitted: set[str] = field(default_factory=set)
    last_admission: float = float("-inf")
    turned_away: dict[str, float] = field(default_factory=dict)  # peer -> when it was first


class UploadBudget:
    def __init__(self, copies: int = 2, grace: float = 3.0, patience: float = 30.0):
        self.copies, self.grace, self.patience = max(1, copies), grace, patience
        self._accounts: dict[object, _Account] = {}

    def register(self, key: object) -> None:
        self._accounts.setdefault(key, _Account())

    def allow(self, key: object, peer: str, now: float, peers_holding: int) -> bool:
        """May the trainer send `peer` chunks of update `key`?"""
        account = self._accounts.get(key)
        if account is None or peer in account.admitted:
            return True
        waited = now - account.turned_away.setdefault(peer, now)
        if (len(account.admitted) < self.copies or waited >= self.patience
                or (peers_holding == 0 and now - account.last_admission >= self.grace)):
            account.admitted.add(peer)
            account.last_admission = now
            account.turned_away.pop(peer, None)
            return True
        if len(account.turned_away) > MAX_WAITING:
            del account.turned_away[next(iter(account.turned_away))]
        return False

    def forget(self, key: object) -> None:
        self._accounts.pop(key, None)


@dataclass
class ByteQuota:
    """A volunteer's upload budget: `rate` bytes a second on average (bursts up to `burst`), and at
    most `per_hour` bytes in any clock hour's window. Anyone can ask a node for chunks, under any
    number of fresh peer ids, so the budget is the node's, not each asker's."""

    rate: float
    burst: float
    per_hour: float
    _tokens: float | None = None
    _at: float = 0.0
    _hour: list[tuple[float, int]] = field(default_factory=list)  # (when, bytes) sent in the last hour

    def take(self, size: int, now: float) -> bool:
        """Spend `size` bytes if the budget allows it now."""
        tokens = self.burst if self._tokens is None else min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._hour = [(t, n) for t, n in self._hour if now - t < 3600]
        allowed = tokens >= size and sum(n for _, n in self._hour) + size <= self.per_hour
        self._tokens, self._at = (tokens - size if allowed else tokens), now
        if allowed:
            self._hour.append((now, size))
        return allowed

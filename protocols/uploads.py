"""How much of each update the trainer uploads itself (pure policy; the relay acts on it).

Nodes that verified an update serve it to others, so the trainer need send only a few copies.
It hands each update whole to the first `copies` nodes that ask (a whole copy, so that node can
relay it soon) and answers later askers "busy" while some peer announces holding the update:
they fetch from peers. While nobody announces holding it (the first downloaders are still at it,
or left), one more node is let in every `grace` seconds, so distribution never stalls.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Account:
    admitted: set[str] = field(default_factory=set)
    last_admission: float = float("-inf")


class UploadBudget:
    def __init__(self, copies: int = 2, grace: float = 3.0):
        self.copies, self.grace = max(1, copies), grace
        self._accounts: dict[object, _Account] = {}

    def register(self, key: object) -> None:
        self._accounts.setdefault(key, _Account())

    def allow(self, key: object, peer: str, now: float, peers_holding: int) -> bool:
        """May the trainer send `peer` chunks of update `key`?"""
        account = self._accounts.get(key)
        if account is None or peer in account.admitted:
            return True
        if len(account.admitted) < self.copies or (peers_holding == 0 and now - account.last_admission >= self.grace):
            account.admitted.add(peer)
            account.last_admission = now
            return True
        return False

    def forget(self, key: object) -> None:
        self._accounts.pop(key, None)

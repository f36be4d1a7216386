"""Sync rules: the node's staleness gate, the version a lease binds, and the trainer's acceptance rule.

Pure state machines: no network, no threads, no clock. Every time-dependent method takes
`now` (seconds, any monotonic origin the caller likes) so the loops that act on these
decisions, and the tests, control time.

Invariants
- Task leases: `protocols.leases`.
- Node gate, staleness bound S >= 1: a node whose version is `node` must update before it
  starts new work when `latest - node >= S`. Work therefore starts at `node >= latest - S + 1`,
  which leaves room for one more publish while it generates.
- A batch's version is its lease's, one version fixed when the lease is issued (`lease_version`):
  the trainer's, or in async mode the node's own when its update failed and its gate admits it.
- Trainer, async mode: a rollout tagged `version` is accepted iff `current - S <= version <=
  current`; older is STALE (an honest straggler: dropped and counted), newer is FUTURE (no
  honest peer can hold a version the trainer has not published).
- Trainer, sequential mode: only `version == current` (the version the trainer asked for) is
  accepted; newer is FUTURE as above, older is WRONG_VERSION rather than STALE, because S
  plays no part in sequential mode and the counter should say "answered the wrong request".
  (Sequential is async with a trainer bound of 0 and a node bound of 1.)
- No rollout key is accepted twice, across restarts too (`to_dict` / `from_dict` carry the
  accepted keys, the current version and every peer's counters). A key names one rollout of
  one version, so the gate remembers it only while the rule admits that version: seen again
  later, it is refused as too old. For every peer, the sum of its counters equals the number
  of offers it made.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from protocols.errors import InvalidValue




class Mode(str, Enum):
    SEQUENTIAL = "sequential"
    ASYNC = "async"


class Verdict(str, Enum):
    ACCEPT = "accept"
    STALE = "stale"
    FUTURE = "future"
    DUPLICATE = "duplicate"
    WRONG_VERSION = "wrong_version"


# Counter names are part of the metrics/dashboard contract, hence spelled out once here.
COUNTER_OF: dict[Verdict, str] = {
    Verdict.ACCEPT: "accepted",
    Verdict.STALE: "dropped_stale",
    Verdict.FUTURE: "rejected_future",
    Verdict.DUPLICATE: "rejected_duplicate",
    Verdict.WRONG_VERSION: "rejected_wrong_version",
}
COUNTERS: tuple[str, ...] = tuple(COUNTER_OF.values())


def check_version(name: str, value: object) -> int:
    # bool is an int subclass; a True version is a bug upstream, not version 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidValue(f"{name} must be an int >= 0, got {value!r}")
    return value


def _check_mode(mode: object) -> Mode:
    try:
        return Mode(mode)
    except ValueError as e:
        choices = [m.value for m in Mode]
        raise InvalidValue(f"sync mode must be one of {choices}, got {mode!r}") from e


def _check_staleness(staleness: object) -> int:
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
        raise InvalidValue(f"staleness bound S must be an int >= 1, got {staleness!r}")
    return staleness


# ----------------------------------------------------------------------------- staleness


def must_update(node_version: int, latest_version: int, staleness: int) -> bool:
    """Node-side gate: True when the node may not start new work before updating."""
    check_version("node_version", node_version)
    check_version("latest_version", latest_version)
    return latest_version - node_version >= _check_staleness(staleness)


def judge_version(mode: Mode, current: int, staleness: int, version: int) -> Verdict:
    """The trainer's version rule, in one place (duplicates are the gate's business)."""
    if version > current:
        return Verdict.FUTURE
    if version >= oldest_admitted(mode, current, staleness):
        return Verdict.ACCEPT
    return Verdict.WRONG_VERSION if _check_mode(mode) is Mode.SEQUENTIAL else Verdict.STALE


def oldest_admitted(mode: Mode, current: int, staleness: int) -> int:
    """The oldest version the trainer at `current` accepts: `current - S` (async), `current` (sequential)."""
    return current if _check_mode(mode) is Mode.SEQUENTIAL else current - staleness


def told_version(mode: Mode, current: int, lag: int = 0) -> int:
    """The version nodes are told is the newest, which async training leases bind: the trainer's
    `current`, or `lag` versions before it (async, for measurement: every trained sample is then
    `lag` versions old or more; docs/protocols.md, "Staleness on demand")."""
    check_version("current", current)
    return current if _check_mode(mode) is Mode.SEQUENTIAL else max(0, current - lag)


def lease_version(mode: Mode, staleness: int, current: int, held: int, update_failed: bool,
                  lag: int = 0) -> int | None:
    """The one version a training lease binds its batch to, for a node that holds `held` when the
    trainer is at `current`; None: the node must update first. Fixed when the lease is issued, so a
    node cannot sample under several versions and push the best. Sequential: `current` (the node
    updates before it samples). Async: the told version (`told_version`: `current` unless a lag is
    set) for a node that holds it, or the node's own when it holds a newer one the trainer has
    published; a node behind is sent to update first, unless it says its update failed
    (`update_failed`) and its own gate still lets it sample (`must_update`): then `held`."""
    check_version("current", current)
    check_version("held", held)
    if _check_mode(mode) is Mode.SEQUENTIAL:
        return current
    if held >= told_version(mode, current, lag):
        return min(held, current)
    if update_failed and not must_update(held, current, staleness):
        return held
    return None


@dataclass(frozen=True)
class Entry:
    """One buffered item (a GRPO group) with the peer that made it and its policy version."""

    peer_id: str
    version: int
    item: Any


class ReplayBuffer:
    """The trainer's FIFO of accepted, version-tagged groups.

    `take` first drops every entry the bound no longer admits (`version < current - S`; the
    trainer may have published since the entry arrived), then hands out the oldest entries, so
    nothing older than S versions is ever trained on, whatever the timing. Sequential mode uses
    S = 0: only groups of the current version survive.
    """

    def __init__(self, staleness: int) -> None:
        if type(staleness) is not int or staleness < 0:
            raise InvalidValue(f"staleness must be an int >= 0, got {staleness!r}")
        self.staleness = staleness
        self._entries: deque[Entry] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        """The buffered entries, oldest first (a snapshot: taking or pruning does not disturb it)."""
        return iter(tuple(self._entries))

    def add(self, peer_id: str, version: int, item: Any) -> None:
        self._entries.append(Entry(peer_id, check_version("version", version), item))

    def prune(self, current: int) -> list[Entry]:
        """Remove and return the entries older than `current - S`."""
        kept = deque(e for e in self._entries if current - e.version <= self.staleness)
        dropped = [e for e in self._entries if current - e.version > self.staleness]
        self._entries = kept
        return dropped

    def take(self, count: int, current: int) -> tuple[list[Entry], list[Entry]]:
        """(up to `count` oldest admissible entries, the entries dropped as stale)."""
        dropped = self.prune(current)
        taken = [self._entries.popleft() for _ in range(min(count, len(self._entries)))]
        return taken, dropped


class RolloutGate:
    """Trainer-side acceptance: version rule, duplicate keys and the run's counters per verdict.

    A key names one rollout of one version, e.g. `(lease_id, sample_index)`: the caller binds
    each key to its version (the service's lease fixes the version its batch must claim,
    `judging.check_claimed_version`). An accepted key is refused as a duplicate whatever version
    it claims next, and is forgotten once the rule no longer admits the version it was accepted
    at: offered again with that version it is refused as too old, so what the gate holds is
    bounded by S versions' keys, not by the run. To survive `to_dict`, keys must be str, int or
    (nested) tuples of those; tuples come back from `from_dict` as tuples even after a JSON or
    msgpack round trip turned them into lists. The counters are the run's totals, not a key's:
    what the gate keeps (and every step writes into state.json) must not grow with the number of
    keys ever seen, and keys are free (the ledger keeps each key's accepted work).
    """

    def __init__(self, mode: Mode, staleness: int, version: int = 0) -> None:
        self.mode = _check_mode(mode)
        # Kept in sequential mode too, unused there, so one config serves both modes.
        self.staleness = _check_staleness(staleness)
        self.version = check_version("version", version)
        self._accepted: dict[Hashable, int] = {}  # key -> the version it was accepted at
        self._counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def offer(self, key: Hashable, version: int) -> Verdict:
        check_version("rollout version", version)
        if key in self._accepted:
            verdict = Verdict.DUPLICATE
        else:
            verdict = judge_version(self.mode, self.version, self.staleness, version)
        if verdict is Verdict.ACCEPT:
            self._accepted[key] = version
        self._counts[COUNTER_OF[verdict]] += 1
        return verdict

    def advance(self, new_version: int) -> None:
        """A publish (async) or the next request (sequential). Versions only move forward."""
        check_version("new_version", new_version)
        if new_version <= self.version:
            raise InvalidValue(f"version must increase: at {self.version}, got {new_version}")
        self.version = new_version
        self._forget_old()

    def _forget_old(self) -> None:
        """Drop the keys of versions the rule no longer admits (they can only come back stale)."""
        oldest = oldest_admitted(self.mode, self.version, self.staleness)
        if any(v < oldest for v in self._accepted.values()):
            self._accepted = {k: v for k, v in self._accepted.items() if v >= oldest}

    def staleness_of(self, version: int) -> int:
        """Versions behind the trainer; negative for a FUTURE rollout. For metrics."""
        return self.version - version

    def counts(self) -> dict[str, int]:
        """Rollouts offered so far, per verdict (`COUNTERS`)."""
        return dict(self._counts)

    def is_accepted(self, key: Hashable) -> bool:
        return key in self._accepted

    def to_dict(self, keys: bool = True) -> dict[str, Any]:
        """The gate's state; `keys`=False leaves its accepted keys out (a caller that keeps them elsewhere)."""
        return {
            "mode": self.mode.value,
            "staleness": self.staleness,
            "version": self.version,
            "counts": dict(self._counts),
            # [version, key] pairs, sorted by repr only so snapshots of equal states are byte-identical.
            "accepted": [[v, _key_out(k)] for k, v in sorted(self._accepted.items(), key=repr)] if keys else [],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutGate:
        if not isinstance(data, Mapping):
            raise InvalidValue("gate state must be a mapping")
        try:
            gate = cls(data["mode"], data["staleness"], data["version"])
            counts = data["counts"]
            # An older release wrote `accepted_keys`, the keys without their versions: taken as
            # of the current version, they are forgotten S versions later.
            pairs, keys = data.get("accepted", []), data.get("accepted_keys", [])
        except KeyError as e:
            raise InvalidValue(f"gate state is missing or has a bad field: {e}") from e
        if not isinstance(counts, Mapping) or not all(isinstance(x, (list, tuple)) for x in (pairs, keys)):
            raise InvalidValue("gate state: counts must be a mapping, accepted and accepted_keys lists")
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise InvalidValue("gate state: accepted must hold [version, key] pairs")
        # An older release kept counters per peer ({peer: {counter: n}}): their sums are the totals.
        per_peer = list(counts.values()) if all(isinstance(c, Mapping) for c in counts.values()) else [counts]
        for c in per_peer:
            if set(c) != set(COUNTERS):
                raise InvalidValue(f"gate state: counters must be {', '.join(COUNTERS)}, got {sorted(map(str, c))}")
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in c.values()):
                raise InvalidValue("gate state: counters must be ints >= 0")
            for name in COUNTERS:
                gate._counts[name] += c[name]
        gate._accepted = {_key_in(k): gate.version for k in keys}
        gate._accepted.update((_key_in(k), check_version("accepted key's version", v)) for v, k in pairs)
        gate._forget_old()
        return gate


def _key_out(key: Hashable) -> Any:
    if isinstance(key, tuple):
        return [_key_out(k) for k in key]
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InvalidValue(f"rollout key {key!r} cannot be exported: use str, int or tuples")
    return key


def _key_in(key: Any) -> Hashable:
    if isinstance(key, (list, tuple)):
        return tuple(_key_in(k) for k in key)
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InvalidValue(f"gate state: bad rollout key {key!r}")
    return key

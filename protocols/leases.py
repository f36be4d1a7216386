"""Task leases: which seeds each node holds, until when, and what happens to them after.

A pure state machine: no network, no threads, no clock. Every time-dependent method takes `now`
(seconds, any monotonic origin the caller likes) so the loops that act on these decisions, and
the tests, control time.

Invariants
- Every seed ever added is in exactly one of pending / outstanding / completed.
  A lease is completed at most once, only by the node it was issued to, and only before it
  expires. Seeds of expired leases go back to the *front* of pending, so they are reissued
  before fresh work and a slow node cannot starve a seed; for `hold` seconds they go to proven
  keys only, so a hoarder that let them lapse cannot take them back the moment they return.
  Each key's lapses (leases that expired unanswered) are counted, less one for each lease it
  completes: the count decays, so a hoarder's one small honest batch does not wipe out what it
  let lapse (issue 55 point 5), and it is kept across a restart (`to_dict`).
  An expired lease may still be completed late while none of its seeds has been leased again: a
  slow honest node's work is not lost to a short lease.
- A lease whose batch is being judged (`pin`) does not expire until the judgment ends: the time
  the trainer takes to judge is its own, and a queue of its making must not lapse an honest
  key's lease and hand its seeds to another. Nor does a queue of its making count against a key
  whose batch it told to wait (`excuse`): if the lease expires meanwhile, that is no lapse.
- A shadow lease (`shadow`) repeats the seeds of another key's short (unproven) lease and owns
  none: the seeds stay that lease's, or pending once it expires. Whichever of the two is
  completed first completes them; the other is `beaten` from then on (never completes a seed).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from protocols.errors import InvalidValue, LeaseError
from protocols.sync import check_version

MAX_CLOSED = 10_000  # closed lease ids a LeaseBook remembers the reason for, and who completed each (~2 MB)
MAX_LAPSED = 100_000  # keys a LeaseBook remembers lapses of (the oldest forgotten first)
MAX_LATE = 10_000  # expired leases a LeaseBook still takes a late answer for
MAX_SHADOWS = 10_000  # shadow leases a LeaseBook holds at once (the oldest dropped first)




@dataclass(frozen=True)
class Lease:
    lease_id: str
    node_id: str
    seeds: tuple[int, ...]
    version: int  # the version its batch must be sampled with (`lease_version`)
    expires_at: float  # same clock as the `now` passed to LeaseBook
    issued_at: float = 0.0

    def short(self, ttl: float) -> bool:
        """Issued for less than the book's standard `ttl`: to a key that has not proven itself."""
        return self.expires_at - self.issued_at < ttl


class LeaseBook:
    """Hands task seeds to nodes for `ttl` seconds; expired seeds are reissued first."""

    def __init__(self, ttl: float, id_prefix: str = "L", hold: float = 0.0) -> None:
        if not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
            raise InvalidValue(f"lease ttl must be a finite number of seconds > 0, got {ttl!r}")
        self.ttl = float(ttl)
        self.hold = float(hold)  # seconds a returned seed goes to proven keys only
        # Ids are a counter, not random, so runs and tests are reproducible. Leases from a
        # previous start may still be in flight: restore its book (`from_dict`), or give this
        # start's book its own prefix.
        self._prefix = id_prefix
        self._next_id = 0
        self._pending: deque[int] = deque()
        self._outstanding: dict[str, Lease] = {}  # insertion order == issue order
        self._held: dict[str, int] = {}  # key -> leases it holds, shadows included (`held_by`, read per request)
        self._known: set[int] = set()  # the seeds it holds: pending or leased, not yet completed
        self._completed_count = 0
        self._expired_count = 0
        # Closed lease ids and why, so a late or repeated completion gets a precise error; only
        # the newest MAX_CLOSED are remembered (older ones are "unknown": refused all the same).
        self._closed: dict[str, tuple[str, str]] = {}  # lease id -> (reason, the key that completed it or "")
        self._returned: dict[int, float] = {}  # pending seed -> when a lease gave it back
        self._late: dict[str, Lease] = {}  # expired leases, newest last, for a late answer
        self._lapses: dict[str, tuple[int, float]] = {}  # key -> (lapses since it last delivered, last one)
        self._shadows: dict[str, tuple[Lease, tuple[str, ...]]] = {}  # shadow lease id -> (it, the leases it repeats)
        self._shadowed: dict[str, set[str]] = {}  # lease id -> keys whose shadows of it are outstanding
        self._shadow_due = math.inf  # no shadow expires before this
        self._beaten: dict[str, Lease] = {}  # leases closed by a shadow's answer, newest last (`beaten`)
        self._pinned: set[str] = set()  # leases whose batches are being judged: they do not expire (`pin`)
        self._excused: set[str] = set()  # leases whose batches were told to wait: their expiry is no lapse (`excuse`)

    @property
    def prefix(self) -> str:
        """What every lease id this book issues starts with."""
        return self._prefix

    @property
    def outstanding(self) -> tuple[Lease, ...]:
        return tuple(self._outstanding.values())

    @property
    def shadows(self) -> tuple[Lease, ...]:
        return tuple(lease for lease, _ in self._shadows.values())

    def beaten(self, lease_id: str, node_id: str) -> Lease | None:
        """`node_id`'s lease `lease_id` if another lease's answer completed its seeds first (a
        shadow's, or the lease a shadow repeats): its holder's answer may still prove the key
        honest, once (`drop_beaten`), and never completes a seed."""
        lease = self._beaten.get(lease_id)
        return lease if lease is not None and lease.node_id == node_id else None

    def drop_beaten(self, lease_id: str) -> None:
        self._beaten.pop(lease_id, None)

    def is_shadow(self, lease_id: str) -> bool:
        return lease_id in self._shadows

    def held_by(self, node_id: str) -> int:
        """Leases `node_id` holds now, shadows included: counted as they come and go, so a lease
        request costs the same however many leases and shadows other keys hold."""
        return self._held.get(node_id, 0)

    def _hold(self, lease: Lease, change: int) -> None:
        held = self._held.get(lease.node_id, 0) + change
        if held:
            self._held[lease.node_id] = held
        else:
            self._held.pop(lease.node_id, None)  # (what is kept per key: only keys holding leases)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def leasable(self, now: float, proven: bool) -> int:
        """Pending seeds a key may be leased now (`issue`)."""
        held_back = set() if proven else self._held_back(now)
        return sum(1 for s in self._pending if s not in held_back)

    def _held_back(self, now: float) -> set[int]:
        """Seeds returned less than `hold` seconds ago: for proven keys only."""
        return {s for s, at in self._returned.items() if now - at < self.hold}

    @property
    def pending_seeds(self) -> tuple[int, ...]:
        return tuple(self._pending)

    @property
    def completed_count(self) -> int:
        """Number of seeds (not leases) completed so far."""
        return self._completed_count

    @property
    def expired_count(self) -> int:
        """Number of leases that expired (their seeds went back to pending) since this book was made."""
        return self._expired_count

    def add_seeds(self, seeds: Iterable[int]) -> None:
        new = list(seeds)
        for seed in new:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise InvalidValue(f"task seeds must be ints, got {seed!r}")
        # A seed the book holds, added again, would sit in two states at once and break
        # conservation. The book forgets the seeds it completed (an async run draws fresh ones
        # for as long as it lasts), so a completed seed added again is a new task.
        if len(set(new)) != len(new) or self._known.intersection(new):
            raise InvalidValue("task seeds must be unique within a lease book")
        self._known.update(new)
        self._pending.extend(new)

    def issue(self, node_id: str, count: int, version: int, now: float, ttl: float | None = None,
              proven: bool = True) -> Lease | None:
        """Lease up to `count` seeds to `node_id` for `ttl` seconds (default: the book's); None when
        nothing is pending for it. A key that is not `proven` gets no seed returned less than
        `hold` seconds ago."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidValue(f"lease count must be an int >= 1, got {count!r}")
        check_version("version", version)
        self.expire(now)
        reserved = set() if proven else self._held_back(now)
        seeds = tuple([s for s in self._pending if s not in reserved][:count])
        if not seeds:
            return None
        taken = set(seeds)
        self._pending = deque(s for s in self._pending if s not in taken)
        for seed in seeds:
            self._returned.pop(seed, None)
        lease = Lease(f"{self._prefix}{self._next_id}", node_id, seeds, version, now + (self.ttl if ttl is None else ttl),
                      now)
        self._next_id += 1
        self._outstanding[lease.lease_id] = lease
        self._hold(lease, 1)
        return lease

    def shadow(self, node_id: str, count: int, version: int, now: float, ttl: float) -> Lease | None:
        """For a key that finds no seed it may take (unproven keys hold them all): a lease for
        `ttl` seconds of up to `count` seeds of other keys' short leases of `version` (ones it
        does not shadow yet: the least shadowed first, then the oldest); None if there are none.
        Keys are free: without it, a few fresh keys that lease and never answer would keep every
        seed from new nodes, and make every step wait out their leases. The shadow answered
        first closes the leases it repeats (`beaten`), whose other seeds go back to the front.
        Not in `to_dict`."""
        self.expire(now)
        candidates = sorted((x for x in self._outstanding.values() if x.node_id != node_id and x.version == version
                             and x.short(self.ttl) and node_id not in self._shadowed.get(x.lease_id, ())),
                            key=lambda x: (len(self._shadowed.get(x.lease_id, ())), x.issued_at))
        originals, seeds = [], []
        for x in candidates:
            if len(seeds) >= count:
                break
            originals.append(x.lease_id)
            seeds += x.seeds[: count - len(seeds)]
        if not seeds:
            return None
        lease = Lease(f"{self._prefix}{self._next_id}", node_id, tuple(seeds), version, now + ttl, now)
        self._next_id += 1
        self._shadows[lease.lease_id] = (lease, tuple(originals))
        self._hold(lease, 1)
        self._shadow_due = min(self._shadow_due, lease.expires_at)
        for original in originals:
            self._shadowed.setdefault(original, set()).add(node_id)
        if len(self._shadows) > MAX_SHADOWS:
            self._drop_shadow(next(iter(self._shadows)), "dropped: too many shadow leases")
        return lease

    def find(self, lease_id: str, now: float) -> Lease | None:
        """The lease `lease_id` if it can still be completed: outstanding, a shadow whose seeds
        are still out or pending, or expired with every seed still pending (nobody has taken
        them since)."""
        # Expire first, so the answer depends only on `now` and not on when expire() last ran.
        self.expire(now)
        lease = self._outstanding.get(lease_id)
        if lease is None and lease_id in self._shadows:
            shadow, originals = self._shadows[lease_id]
            out = {s for o in originals if o in self._outstanding for s in self._outstanding[o].seeds}
            if set(shadow.seeds) <= out | set(self._pending):
                lease = shadow
            else:  # its seeds were answered, or leased again
                self._beat(shadow)
                self._drop_shadow(lease_id, "answered by another key")
        if lease is None and lease_id in self._late:
            late = self._late[lease_id]
            lease = late if set(late.seeds) <= set(self._pending) else None
        return lease

    def complete(self, lease_id: str, node_id: str, now: float) -> Lease:
        """Close a lease as done (`find`). Single use; refuses other nodes' leases and expired
        leases whose seeds went out again."""
        lease = self.find(lease_id, now)
        if lease is None:
            reason = self._closed.get(lease_id, ("unknown", ""))[0]
            raise LeaseError(f"lease {lease_id!r} is {reason}")
        if lease.node_id != node_id:
            # Left outstanding: the rightful holder may still complete it.
            raise LeaseError(f"lease {lease_id!r} is held by another node")
        if lease_id in self._outstanding:
            self._hold(self._outstanding.pop(lease_id), -1)
            if lease_id in self._shadowed:  # (a scan of the shadows only then: completing is a hot path)
                for shadow, _ in [x for x in self._shadows.values() if lease_id in x[1]]:
                    self._beat(shadow)  # their answers now come second
                    self._drop_shadow(shadow.lease_id, "answered by another key")
        elif lease_id in self._shadows:
            done = set(lease.seeds)
            for original in self._drop_shadow(lease_id, "already completed"):
                if original in self._outstanding:  # its holder's answer now comes second
                    beaten = self._outstanding.pop(original)
                    self._hold(beaten, -1)
                    self._beat(beaten)
                    self._close(original, "answered by another key")
                    rest = [s for s in beaten.seeds if s not in done]
                    self._returned.update(dict.fromkeys(rest, now))
                    self._pending.extendleft(reversed(rest))
            self._take_pending(done)  # those whose lease had expired
        else:  # late: its seeds leave pending
            del self._late[lease_id]
            self._take_pending(lease.seeds)
        self._close(lease_id, "already completed", node_id)
        self._completed_count += len(lease.seeds)
        self._known.difference_update(lease.seeds)  # a long async run completes millions of seeds
        self._forgive_one_lapse(node_id)
        return lease

    def _forgive_one_lapse(self, node_id: str) -> None:
        count, last = self._lapses.get(node_id, (0, 0.0))
        if count > 1:
            self._lapses[node_id] = (count - 1, last)
        else:
            self._lapses.pop(node_id, None)

    def pin(self, lease_id: str) -> None:
        """Its batch is being judged: the lease does not expire until `unpin`."""
        self._pinned.add(lease_id)

    def unpin(self, lease_id: str) -> None:
        """Judged: the lease expires as any other (at the next `expire`, if it is past due)."""
        self._pinned.discard(lease_id)

    def excuse(self, lease_id: str, node_id: str) -> None:
        """`node_id` pushed its batch for `lease_id` and was told to push again later (the trainer
        is busy): if the lease expires before its batch gets in, the wait was ours, not a lapse."""
        lease = self._outstanding.get(lease_id) or self._shadows.get(lease_id, (None, ""))[0]
        if lease is not None and lease.node_id == node_id:
            self._excused.add(lease_id)

    def expire(self, now: float) -> list[Lease]:
        """Close leases with `expires_at <= now` that are not `pin`ned, oldest first; their seeds
        go back to the front, and each counts as a lapse of its key (so does an expired shadow:
        it has no seeds) unless it was `excuse`d."""
        expired = [lease for lease in self._outstanding.values()
                   if lease.expires_at <= now and lease.lease_id not in self._pinned]
        excused = self._excused.intersection(lease.lease_id for lease in expired) if self._excused else set()
        self._reopen(expired, "expired")
        self._expired_count += len(expired)
        shadows = []
        if now >= self._shadow_due:  # every call scans the shadows (up to MAX_SHADOWS) only once one is due
            shadows = [lease for lease, _ in self._shadows.values()
                       if lease.expires_at <= now and lease.lease_id not in self._pinned]
            excused.update(self._excused.intersection(lease.lease_id for lease in shadows))
            for lease in shadows:
                self._drop_shadow(lease.lease_id, "expired")
            self._shadow_due = min((lease.expires_at for lease, _ in self._shadows.values()), default=math.inf)
        for lease in expired + shadows:
            self._late[lease.lease_id] = lease
            if len(self._late) > MAX_LATE:
                del self._late[next(iter(self._late))]
            if lease.lease_id in excused:
                continue
            count, _ = self._lapses.pop(lease.node_id, (0, 0.0))
            self._lapses[lease.node_id] = (count + 1, lease.expires_at)  # re-inserted: the newest last
            if len(self._lapses) > MAX_LAPSED:
                del self._lapses[next(iter(self._lapses))]
        return expired

    def lapses(self, node_id: str) -> tuple[int, float]:
        """How many of `node_id`'s leases expired unanswered since it last completed one, and when the last did."""
        return self._lapses.get(node_id, (0, 0.0))

    def release(self, lease_id: str, node_id: str, now: float) -> Lease:
        """The holder's attempt failed (its batch was refused): close the lease and put its seeds
        back at the front now, rather than leaving them idle until it expires (a shadow's stay
        with the lease it repeats)."""
        lease = self._outstanding.get(lease_id) or self._shadows.get(lease_id, (None, ""))[0]
        if lease is None or lease.node_id != node_id:
            raise LeaseError(f"lease {lease_id!r} is not outstanding for this node")
        if lease_id in self._shadows:
            self._drop_shadow(lease_id, "released")
        else:
            self._reopen([lease], "released", now)
        return lease

    def knows(self, seed: int) -> bool:
        """Does the book hold `seed` (pending or leased, not completed)?"""
        return seed in self._known

    def to_dict(self) -> dict[str, Any]:
        """What a restart needs to go on handing out and taking back the same leases: pending
        seeds, outstanding leases and the id counter (not shadows: their holders' answers are
        refused after a restart, and the seeds are still the leases'). Completed seeds and the reasons of closed
        ids are left out (they grow with the run): after a restart a closed id is "unknown",
        refused all the same, and the caller must not add a completed seed again."""
        return {
            "ttl": self.ttl, "prefix": self._prefix, "next_id": self._next_id, "pending": list(self._pending),
            "outstanding": [[x.lease_id, x.node_id, list(x.seeds), x.version, x.expires_at, x.issued_at]
                            for x in self._outstanding.values()],
            "lapses": [[key, count, last] for key, (count, last) in self._lapses.items()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LeaseBook:
        if not isinstance(data, Mapping):
            raise InvalidValue("lease book state must be a mapping")
        try:
            book = cls(data["ttl"], data["prefix"])
            book._next_id = check_version("lease book next_id", data["next_id"])
            pending = list(data["pending"])
            # A book saved before leases carried their issue time: a standard lease's.
            leases = [Lease(x[0], x[1], tuple(x[2]), check_version("lease version", x[3]), float(x[4]),
                            float(x[5]) if len(x) > 5 else float(x[4]) - book.ttl)
                      for x in data["outstanding"]]
            lapses = {str(k): (check_version("lapse count", n), float(t))  # (a book saved before: none)
                      for k, n, t in data.get("lapses", [])[-MAX_LAPSED:]}
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise InvalidValue(f"lease book state is missing or has a bad field: {e!r}") from None
        if not all(isinstance(x.lease_id, str) and isinstance(x.node_id, str) for x in leases):
            raise InvalidValue("lease book state: lease and node ids must be strings")
        book.add_seeds(pending + [s for x in leases for s in x.seeds])  # checks them: ints, none held twice
        book._pending = deque(pending)
        book._outstanding = {x.lease_id: x for x in leases}
        for x in leases:
            book._hold(x, 1)
        book._lapses = lapses
        return book

    def completed_by(self, lease_id: str) -> str | None:
        """The key that completed `lease_id` (among the newest MAX_CLOSED closed), if one did."""
        return self._closed.get(lease_id, ("", ""))[1] or None

    def _close(self, lease_id: str, reason: str, by: str = "") -> None:
        self._closed[lease_id] = (reason, by)
        self._excused.discard(lease_id)
        if len(self._closed) > MAX_CLOSED:
            del self._closed[next(iter(self._closed))]  # dicts keep insertion order: the oldest

    def _beat(self, lease: Lease) -> None:
        """Another lease's answer completed `lease`'s seeds first (`beaten`)."""
        self._beaten[lease.lease_id] = lease
        if len(self._beaten) > MAX_LATE:
            del self._beaten[next(iter(self._beaten))]

    def _drop_shadow(self, lease_id: str, reason: str) -> tuple[str, ...]:
        """Close shadow `lease_id`; the ids of the leases it repeats."""
        shadow, originals = self._shadows.pop(lease_id)
        self._hold(shadow, -1)
        self._close(lease_id, reason)
        for original in originals:
            keys = self._shadowed.pop(original)
            keys.discard(shadow.node_id)
            if keys:
                self._shadowed[original] = keys
        return originals

    def _take_pending(self, seeds: Iterable[int]) -> None:
        """A late answer's seeds leave pending."""
        done = set(seeds)
        self._pending = deque(s for s in self._pending if s not in done)
        for seed in done:
            self._returned.pop(seed, None)

    def _reopen(self, leases: list[Lease], reason: str, now: float | None = None) -> None:
        """Seeds back to the front of pending, returned at `now` (None: when each lease expired)."""
        for lease in leases:
            self._hold(self._outstanding.pop(lease.lease_id), -1)
            self._close(lease.lease_id, reason)
            self._returned.update(dict.fromkeys(lease.seeds, lease.expires_at if now is None else now))
        seeds = [s for lease in leases for s in lease.seeds]
        # extendleft reverses its input; reversing first keeps the oldest lease's seeds first.
        self._pending.extendleft(reversed(seeds))

"""What the service knows per node key (a node's signing key fingerprint, its id).

Learnt from its signed lease requests only (name, backend, batch size, hardware, held version, the
libp2p peer it spoke from, liveness): the coordinator reads no DHT announcement. Keys are free, so everything here
is forgotten once a key has been quiet for a while (`prune`): it must not grow with every key
ever seen.
"""

from __future__ import annotations

from collections.abc import Mapping

from echo_coordinator.capacity import Throughput
from echo_coordinator.service.policing import RateLimit, relay_holders
from protocols.errors import PeerRefused
from protocols.messages import LeaseRequest, TaskLease
from protocols.supervise import Backoff

LEASE_RATE = RateLimit(rate=4.0, burst=8.0)  # lease requests per key; an honest node asks every 0.5 s at most
LIVE_SECONDS = 15.0  # a node waiting for work asks every 0.5 s (one generating a lease asks again when it is done)
# After a restart, how long nodes that were working before it are waited for at the end of the run:
# one that cannot reach the coordinator asks again within its longest retry delay.
RESTART_PATIENCE = Backoff.cap + 5.0


class Registry:
    """Per node key: what it said and when. No lock of its own: the service's lock guards it."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}  # node id -> display name from its (signed) lease requests
        self.last_seen: dict[str, float] = {}  # node id -> time of its last signed lease request
        self.backends: dict[str, str] = {}  # node id -> backend it says it samples with (display only)
        self.parallel: dict[str, int] = {}  # node id -> sequences it says it decodes at once
        self.hardware: dict[str, str] = {}  # node id -> the hardware its lease requests name (display only)
        self.talked: dict[str, str] = {}  # node id -> libp2p peer its last lease request came from
        self.told_finished: dict[str, int] = {}  # nodes that have heard the run is over -> the version they held
        self.expected: frozenset[str] = frozenset()  # nodes working before a restart (see `expect`)
        self.expected_until = 0.0  # when the run stops waiting for them
        self.lease_rate = RateLimit(LEASE_RATE.rate, LEASE_RATE.burst)
        self.throughput = Throughput()  # measured rollout throughput per node (the capacity model's μ_i)
        # Training leases each key was given, and of those it pushed a batch for (any verdict):
        # what it leaves to lapse is measured (selective reporting, issue 36 point 4).
        self.leased: dict[str, int] = {}
        self.answered: dict[str, int] = {}
        # node id -> (its last lease request's signed time, the lease it was given): a request sent
        # again because its reply was lost gets the same lease, not a second one (`repeated`).
        self.last_lease: dict[str, tuple[float, TaskLease]] = {}

    def heard(self, request: LeaseRequest, peer_id: str, now: float) -> None:
        """A signed lease request, from libp2p peer `peer_id` ("": unknown). Past its key's rate
        limit it is refused before anything is noted."""
        node_id = request.node_id
        if not self.lease_rate.allow(node_id, now):
            raise PeerRefused("rate_limited", f"more than {LEASE_RATE.rate:g} lease requests a second")
        self.names[node_id], self.last_seen[node_id] = request.name, now
        self.backends[node_id], self.parallel[node_id] = request.backend, request.parallel
        if request.hardware:
            self.hardware[node_id] = request.hardware
        self.throughput.holds(node_id, request.version, now)
        if peer_id:
            self.talked[node_id] = peer_id

    def name(self, node_id: str) -> str:
        return self.names.get(node_id, node_id[:8])

    def all_told_finished(self, now: float, holding: set[str]) -> bool:
        """Every node that asked for work lately or holds a lease (`holding`: one generating a
        long lease asks again only when it is done) has heard, and after a restart every node
        that worked before it (`expect`: one may be waiting out a retry delay). A key that has
        not asked for `LIVE_SECONDS` and holds nothing is gone (killed, or one of a flood of
        fresh keys): the end of the run does not wait for it."""
        asking = {n for n, at in self.last_seen.items() if now - at < LIVE_SECONDS}
        expected = self.expected if now < self.expected_until else set()
        return asking | holding | expected <= self.told_finished.keys()

    def proven(self, node_id: str, now: float) -> bool:
        """Has the key had a batch accepted lately? (A claim alone earns a key nothing.)"""
        return self.throughput.rate(node_id, now) is not None

    def relay_holders(self, now: float, latest: int) -> tuple[dict[str, int], frozenset[str]]:
        """libp2p peer -> version it holds, of the keys that asked for work lately (`relay_holders`),
        and which of those peers spoke for a `proven` key. Not only keys with work accepted: at a
        run's start nodes fetch the base from each other before any has worked."""
        asking = [n for n, at in self.last_seen.items() if now - at < LIVE_SECONDS and n in self.talked]
        holders = relay_holders({n: self.talked[n] for n in asking},
                                {n: self.throughput.held[n] for n in asking if n in self.throughput.held}, latest)
        return holders, frozenset(self.talked[n] for n in asking if self.proven(n, now))

    def working(self, now: float) -> list[str]:
        """Keys that asked lately and are `proven`: those a restart should wait for. (Only keys
        that delivered: keys are free, and this list is saved at every step.)"""
        return sorted(n for n, at in self.last_seen.items() if now - at < LIVE_SECONDS and self.proven(n, now))

    def expect(self, node_ids: list[str]) -> None:
        """After a restart: nodes that were `working` before it. Until they have heard, or for
        `RESTART_PATIENCE` after work is handed out again (`serving`), the run does not end
        without them: the DHT need not show them yet, and a node waiting out a retry delay
        would miss a short restarted run."""
        self.expected = frozenset(node_ids)

    def serving(self, now: float) -> None:
        self.expected_until = now + RESTART_PATIENCE

    def prune(self, now: float, idle: float) -> None:
        """Forget keys that have not asked for work in `idle` seconds (names, rate buckets)."""
        for node_id in [n for n, at in self.last_seen.items() if now - at > idle]:
            del self.last_seen[node_id]
            self.names.pop(node_id, None)
            self.backends.pop(node_id, None)
            self.parallel.pop(node_id, None)
            self.hardware.pop(node_id, None)
            self.throughput.forget(node_id)
            self.talked.pop(node_id, None)
            self.told_finished.pop(node_id, None)
            self.leased.pop(node_id, None)
            self.answered.pop(node_id, None)
            self.last_lease.pop(node_id, None)
        self.lease_rate.forget_idle(now)

    def lease_given(self, request: LeaseRequest, lease: TaskLease) -> None:
        if not lease.evaluation:
            self.leased[request.node_id] = self.leased.get(request.node_id, 0) + 1
        self.last_lease[request.node_id] = (request.time, lease)

    def repeated(self, request: LeaseRequest) -> TaskLease | None:
        """The lease given for this very request (same key, same signed time), if it was asked
        before: its reply was lost with a broken stream, and the node sends it again."""
        time, lease = self.last_lease.get(request.node_id, (None, None))
        return lease if time == request.time else None

    def lease_answered(self, node_id: str) -> None:
        self.answered[node_id] = self.answered.get(node_id, 0) + 1

    def abandoned(self, node_id: str, holds: int = 0) -> float | None:
        """The share of its training leases a key left unanswered (since it was last pruned), of
        those no longer out: `holds` (the leases it holds now) may still be answered."""
        done = self.leased.get(node_id, 0) - holds
        return 1 - min(self.answered.get(node_id, 0), done) / done if done > 0 else None

    def nodes(self, now: float, holding: Mapping[str, int]) -> dict[str, dict]:
        """Per node seen in the last `prune` window: its backend, held version, measured throughput
        and the share of its training leases it abandoned (`holding`: training leases out per key)."""
        rates = self.throughput.rates(now)
        return {n: dict(name=self.name(n), backend=self.backends.get(n, ""), parallel=self.parallel.get(n, 1),
                        hardware=self.hardware.get(n, ""), holds=self.throughput.held.get(n),
                        samples_per_second=rates.get(n), last_request=at,
                        abandoned=self.abandoned(n, holding.get(n, 0)))
                for n, at in self.last_seen.items()}

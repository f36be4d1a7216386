"""The coordinator's handlers: pushes waiting for verification, and leases waiting for their
journal write, never hold up lease requests."""

import asyncio
import threading
from concurrent.futures import Future

from echo_coordinator.handlers import LEASE_THREADS, PUSH_THREADS, register_handlers
from protocols import rpc
from protocols.messages import NoWork, PushReceipt
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id


class Served:
    """Stands in for an Endpoint: keeps the handlers it is asked to serve."""

    def __init__(self):
        self.handlers = {}

    async def serve(self, what, handler, with_address=False):
        self.handlers[what.name] = handler


class Service:
    """Pushes wait (as for the torch thread, behind a training step) until `release` is set."""

    manifest = factories.manifest()

    def __init__(self):
        self.release, self.relay = threading.Event(), self

    async def serve(self, endpoint):  # the relay's handlers
        pass

    def handle_push(self, request, peer):
        self.release.wait(30)
        return PushReceipt(accepted=1, rejected=0, latest_version=0)

    def issue_lease(self, request, peer, now):
        return NoWork(0, 1.0), None


def test_a_lease_is_answered_while_every_push_thread_waits_for_verification():
    async def go():
        endpoint, service = Served(), Service()
        await register_handlers(endpoint, service, presence=None, prober=None)

        async def one(name, request):
            return [reply async for reply in endpoint.handlers[name](request, peer_id("Peer"))]

        # Submitted first (tasks start in order): every push thread is taken, more pushes queue.
        waiting = [asyncio.create_task(one(rpc.PUSH.name, b"batch")) for _ in range(PUSH_THREADS + 4)]
        lease = await asyncio.wait_for(one(rpc.LEASE.name, factories.lease_request()), 5)
        assert lease[0].retry_after == 1.0
        service.release.set()
        assert len(await asyncio.gather(*waiting)) == PUSH_THREADS + 4

    asyncio.run(go())


class Journaling(Service):
    """Every lease request from `busy` gets a lease whose journal write waits until the test ends
    it (the ledger's thread behind other work); others get NoWork."""

    busy = factories.lease_request().node_id

    def __init__(self):
        super().__init__()
        self.writes: list[Future] = []
        self.handed, self.written = 0, False

    def issue_lease(self, request, peer, now):
        if request.node_id != self.busy:
            return NoWork(0, 1.0), None
        self.writes.append(Future())
        if self.written:
            self.writes[-1].set_result(None)
        return factories.lease(), self.writes[-1]

    def hand_over(self, request, work, now):
        self.handed += 1
        return work

    def handle_lease(self, request, peer):  # the three parts in one thread, as before
        work, saved = self.issue_lease(request, peer, 0.0)
        if saved is not None:
            saved.result()
        return self.hand_over(request, work, 0.0)


def test_leases_waiting_for_their_journal_write_hold_no_lease_thread():
    """At 1,000 volunteers the ledger's thread was busy and each lease held one of the 4 lease
    threads while its journal write waited: other requests queued behind them (p99 0.75 s)."""
    async def go():
        endpoint, service = Served(), Journaling()
        await register_handlers(endpoint, service, presence=None, prober=None)

        async def one(request):
            return [reply async for reply in endpoint.handlers[rpc.LEASE.name](request, peer_id("Peer"))]

        waiting = [asyncio.create_task(one(factories.lease_request())) for _ in range(LEASE_THREADS + 4)]
        for _ in range(200):  # until every one waits for its write (before: only the 4 on lease threads did)
            if len(service.writes) == LEASE_THREADS + 4:
                break
            await asyncio.sleep(0.01)
        other = factories.lease_request(node_key=bytes(32))
        try:
            assert (await asyncio.wait_for(one(other), 5))[0].retry_after == 1.0
            assert service.handed == 0  # nobody has a lease whose journal write is not done
        finally:
            service.written = True
            for write in service.writes:
                write.set_result(None)
        assert all(reply == [factories.lease()] for reply in await asyncio.gather(*waiting))
        assert service.handed == LEASE_THREADS + 4

    asyncio.run(go())

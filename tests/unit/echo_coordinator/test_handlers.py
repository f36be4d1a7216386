"""The coordinator's handlers: pushes waiting for verification never hold up lease requests."""

import asyncio
import threading

from echo_coordinator.handlers import PUSH_THREADS, register_handlers
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

    def handle_lease(self, request, peer):
        return NoWork(0, 1.0)


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

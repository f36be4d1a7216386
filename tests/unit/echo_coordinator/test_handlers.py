"""The coordinator's handlers: pushes waiting for verification never hold up lease requests,
leases waiting for their journal write hold no lease thread, and new keys' batches waiting their
turn never hold up proven keys' pushes."""

import asyncio
import threading
from concurrent.futures import Future

from echo_coordinator.handlers import LEASE_THREADS, PUSH_THREADS, register_handlers
from echo_coordinator.service.pushes import NEW_KEY_PUSHES, Queued
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

    async def call(self, name, request):
        """The replies the handler `name` yields for `request`."""
        return [reply async for reply in self.handlers[name](request, peer_id("Peer"))]


class Service:
    """Pushes wait (as for the torch thread, behind a training step) until `release` is set."""

    manifest = factories.manifest()

    def __init__(self):
        self.release, self.relay = threading.Event(), self
        self.left = []  # how queued batches left the line (`leave_line`)
        self.unsaved, self.saved = 0, Future()

    async def serve(self, endpoint):  # the relay's handlers
        pass

    def receive_push(self, request, peer):
        if request == b"new":  # a new key's batch: judged in the new keys' line (`judge_queued`)
            return Queued(self, request, peer, None)
        if request == b"batch":
            self.release.wait(30)
        return PushReceipt(accepted=1, rejected=0, latest_version=0)

    def judge_queued(self, queued, now):
        self.release.wait(30)
        return PushReceipt(accepted=2, rejected=0, latest_version=0)

    def leave_line(self, queued, state):
        self.left.append(state)

    def issue_lease(self, request, peer):
        """The first `unsaved` leases wait for one journal write (`saved`); later ones for none."""
        if self.unsaved > 0:
            self.unsaved -= 1
            return NoWork(0, 2.0), self.saved
        return NoWork(0, 1.0), None


def test_a_lease_is_answered_while_every_push_thread_waits_for_verification():
    async def go():
        endpoint, service = Served(), Service()
        await register_handlers(endpoint, service, presence=None, prober=None)

        # Submitted first (tasks start in order): every push thread is taken, more pushes queue.
        waiting = [asyncio.create_task(endpoint.call(rpc.PUSH.name, b"batch")) for _ in range(PUSH_THREADS + 4)]
        lease = await asyncio.wait_for(endpoint.call(rpc.LEASE.name, factories.lease_request()), 5)
        assert lease[0].retry_after == 1.0
        service.release.set()
        assert len(await asyncio.gather(*waiting)) == PUSH_THREADS + 4

    asyncio.run(go())


def test_leases_waiting_for_their_journal_write_hold_no_lease_thread():
    async def go():
        endpoint, service = Served(), Service()
        await register_handlers(endpoint, service, presence=None, prober=None)
        service.unsaved = LEASE_THREADS + 5
        service.saved.set_running_or_notify_cancel()  # as `Journal.save` makes it

        waiting = [asyncio.create_task(endpoint.call(rpc.LEASE.name, factories.lease_request()))
                   for _ in range(LEASE_THREADS + 5)]
        while service.unsaved:  # every one decided, waiting for the write
            await asyncio.sleep(0.01)
        waiting.pop().cancel()  # a stream that went away while its lease waited ...
        lease = await asyncio.wait_for(endpoint.call(rpc.LEASE.name, factories.lease_request()), 5)
        assert lease[0].retry_after == 1.0 and not any(w.done() for w in waiting)
        service.saved.set_result(None)  # ... cancels nothing of the journal's
        assert [r[0].retry_after for r in await asyncio.gather(*waiting)] == [2.0] * (LEASE_THREADS + 4)

    asyncio.run(go())


def test_new_keys_batches_waiting_their_turn_hold_no_push_thread_and_leave_the_line_when_dropped():
    async def go():
        endpoint, service = Served(), Service()
        await register_handlers(endpoint, service, presence=None, prober=None)

        # Every new-key thread judging, and more than all the push threads' worth waiting in line.
        line = [asyncio.create_task(endpoint.call(rpc.PUSH.name, b"new")) for _ in range(NEW_KEY_PUSHES + PUSH_THREADS + 4)]
        proven = await asyncio.wait_for(endpoint.call(rpc.PUSH.name, b"proven"), 5)
        assert proven[0].accepted == 1
        line[-1].cancel()  # its node went away while it waited: it leaves the line, never judged
        await asyncio.gather(line[-1], return_exceptions=True)
        assert service.left == ["abandoned"]
        service.release.set()
        replies = await asyncio.gather(*line[:-1])
        assert [r[0].accepted for r in replies] == [2] * (NEW_KEY_PUSHES + PUSH_THREADS + 3)

    asyncio.run(go())

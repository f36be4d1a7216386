"""The coordinator's stream handlers, and the wait for the first nodes to ask for work.

Each handler gets its request decoded (`protocols.rpc`) and hands it to the service: a lease and
a push run on a thread of their own (a push waits there for its verification on the torch
thread; a lease is decided there and waits for its journal write on the loop), so the event loop
never waits for them. Leases and pushes have separate pools: pushes can wait minutes for the
torch thread, and must never hold the threads leases need. A new key's batch waits its turn in
their line holding no thread, and is judged on threads of its own
(`service.pushes.Queued`)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from echo_coordinator.display import Display
from echo_coordinator.presence import Presence
from echo_coordinator.service import RunService
from echo_coordinator.service.pushes import NEW_KEY_PUSHES, Queued
from protocols import rpc
from protocols.messages import HoldersRequest, LeaseRequest, ReachRequest


# A lease is decided on a lease thread and waits for its journal write on the event loop, holding
# no thread: a save rides on the writes already queued (`Journal.save`), so waiting leases add no
# writes. (Before saves were coalesced, leases waiting on the loop each queued a write of their
# own and flooded the ledger's thread: 2026-12-05, push p50 159 -> 369 ms, samples/s -15 %.)
LEASE_THREADS = 4
PUSH_THREADS = 16  # pushes in flight at once; more wait for a thread (each holds only its request bytes)


async def register_handlers(endpoint, service: RunService, presence: Presence, prober) -> None:
    loop = asyncio.get_running_loop()
    leases = ThreadPoolExecutor(LEASE_THREADS, thread_name_prefix="lease")
    pushes = ThreadPoolExecutor(PUSH_THREADS, thread_name_prefix="push")
    new_keys = ThreadPoolExecutor(NEW_KEY_PUSHES, thread_name_prefix="new-key")  # its queue is their line

    async def manifest(request: None, peer: str):
        yield service.manifest

    async def lease(request: LeaseRequest, peer: str):
        reply, saved = await loop.run_in_executor(leases, service.issue_lease, request, peer)
        if saved is not None:
            await asyncio.wrap_future(saved)
        yield reply

    async def push(request: bytes, peer: str):  # the wire bytes: the service decodes them in stages
        reply = await loop.run_in_executor(pushes, service.receive_push, request, peer)
        if isinstance(reply, Queued):
            queued, judged = reply, loop.run_in_executor(new_keys, reply.judge)
            try:
                reply = await judged
            finally:
                if judged.cancelled():  # the stream went away: out of the line, if its turn has not come
                    queued.abandon()
        yield reply

    async def reach(request: ReachRequest, peer: str, observed: str):
        reply = await prober.answer(request, peer, observed)
        if reply.reachable:
            presence.reached(peer, relayed=request.relayed)
        yield reply

    async def holders(request: HoldersRequest, peer: str):
        yield presence.holders(request, peer)

    await endpoint.serve(rpc.MANIFEST, manifest)
    await endpoint.serve(rpc.REACH, reach, with_address=True)
    await endpoint.serve(rpc.HOLDERS, holders)
    await endpoint.serve(rpc.LEASE, lease)
    await endpoint.serve(rpc.PUSH, push)
    await service.relay.serve(endpoint)  # echo.update, echo.updates, echo.chunks


async def wait_for_nodes(count: int, service: RunService, display: Display) -> None:
    """Until `count` nodes have asked us for work over their own streams."""
    shown = -1
    while True:
        nodes = len(service.talked())
        if nodes >= count:
            return
        if nodes != shown:
            display.waiting(f"waiting for nodes: {nodes}/{count} have asked for work")
            shown = nodes
        await asyncio.sleep(0.5)

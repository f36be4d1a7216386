"""The coordinator's stream handlers, and the wait for the first nodes to ask for work.

Each handler decodes its request and hands it to the service: a lease and a push run on a
thread of their own (a lease waits for its journal write, a push for its verification on the
torch thread), so the event loop never waits for them."""

from __future__ import annotations

import asyncio

from echo_coordinator.display import Display
from echo_coordinator.service import RunService
from protocols import rpc
from protocols.messages import LeaseRequest, ReachRequest


async def register_handlers(endpoint, service: RunService, prober) -> None:
    async def manifest(request: bytes, peer: str):
        yield service.manifest.to_wire()

    async def lease(request: bytes, peer: str):
        # Off the loop: a lease waits for its journal write.
        reply = await asyncio.to_thread(service.handle_lease, LeaseRequest.from_wire(request), peer)
        yield reply.to_wire()

    async def push(request: bytes, peer: str):
        receipt = await asyncio.to_thread(service.handle_push, request, peer)
        yield receipt.to_wire()

    async def reach(request: bytes, peer: str, observed: str):
        yield (await prober.answer(ReachRequest.from_wire(request), peer, observed)).to_wire()

    await endpoint.serve(rpc.MANIFEST, manifest)
    await endpoint.serve(rpc.REACH, reach, with_address=True)
    await endpoint.serve(rpc.LEASE, lease)
    await endpoint.serve(rpc.PUSH, push)
    await service.relay.serve(endpoint)  # echo.update, echo.updates, echo.chunks


async def wait_for_nodes(count: int, service: RunService, display: Display) -> None:
    """Until `count` nodes have asked us for work over their own streams. A DHT announcement
    alone does not count: anyone can announce any number of nodes."""
    shown = -1
    while True:
        nodes = len(service.talked())
        if nodes >= count:
            return
        if nodes != shown:
            display.waiting(f"waiting for nodes: {nodes}/{count} have asked for work")
            shown = nodes
        await asyncio.sleep(0.5)

"""Who may make whom upload what, over the real transport (issue 23 items 2 and 13).

The trainer's upload budget (`protocols.uploads.UploadBudget`) sends each update whole to the
first askers and turns later ones away while peers say they hold it: fresh keys that fetch
first and then claim the version (or any version) and never serve it must not keep honest nodes
waiting. A volunteer's node serves whoever asks, under any number of fresh peer ids: what it
uploads in all is the volunteer's budget (`ByteQuota`), not each asker's."""

from __future__ import annotations

import asyncio
import time

from echo_node.updates import UpdateError, catch_up
from protocols import rpc
from protocols.errors import RemoteError, TransportError
from protocols.messages import ChunkRequest, NoWork
from protocols.signing import generate_key
from protocols.supervise import retry
from protocols.uploads import UploadBudget
from tests.support.hostile_coordinator import HostileCoordinator
from tests.support.live_service import LiveService, Peer
from tests.support.runs import named

MIB = 2**20


async def sybils_fetch_then_claim(coordinator: LiveService, claim: int) -> list[Peer]:
    """Two fresh keys, each on its own peer, fetch version 1 from the trainer (taking its
    copies), then say they hold version `claim` in their lease requests and serve nothing.
    Returns their peers once the coordinator's presence has refreshed."""
    chunks = coordinator.publish(1)
    sybils: list[Peer] = []
    try:
        sybils += await Peer.many(coordinator.address, 2)
        keys = [generate_key() for _ in sybils]
        for sybil, key in zip(sybils, keys):
            # Retried as a node retries a broken stream (a loaded make test broke one once): the
            # sybils' fetch sets the scene; what is tested is the honest node's wait after it.
            got = await retry(lambda: sybil.endpoint.call(coordinator.peer, rpc.CHUNKS, ChunkRequest(tuple(chunks)).to_wire()),
                              TransportError, give_up=lambda e, delay: delay > 2)
            assert len(got) == len(chunks)  # the trainer's copies went to them
            await sybil.ask(coordinator, key, version=claim)
        await coordinator.refreshed()  # the coordinator's presence has looked again
        return sybils
    except BaseException:
        await asyncio.gather(*(s.shutdown() for s in sybils))
        raise


async def honest_catch_up(coordinator: LiveService, holders: list[str], within: float) -> tuple[float, int]:
    """A node's catch-up to version 1, retried while the trainer says busy as a node does (every
    0.3 s): how long it took, and how often it was turned away. The claimed holders are asked too."""
    node = await Peer.start(coordinator.address)
    applied, busy, started = [], 0, time.monotonic()

    async def apply(update, store, payloads):
        applied.append(update.to_version)

    try:
        async with asyncio.timeout(within):
            while not applied:
                try:
                    await catch_up(node.endpoint, coordinator.peer, named(*holders),
                                   coordinator.manifest, 0, 1, apply, 10.0)
                except UpdateError as e:
                    assert e.busy, e
                    busy += 1
                    await asyncio.sleep(0.3)
    except TimeoutError:
        raise AssertionError(f"the honest node was turned away for {within} s ({busy} times)") from None
    finally:
        await node.shutdown()
    return time.monotonic() - started, busy


def test_claims_of_a_version_not_yet_published_hold_no_one_back(tmp_path):
    """Sybils take the trainer's copies of version 1, then claim version 10**9: no such claim
    counts as holding version 1, so the trainer lets the honest node in within its grace (3 s)."""
    async def go():
        async with LiveService(tmp_path) as coordinator:  # the budget as the coordinator builds it
            sybils = await sybils_fetch_then_claim(coordinator, claim=10**9)
            assert coordinator.presence.holding(1) == 0
            try:
                return await honest_catch_up(coordinator, [s.peer_id for s in sybils], within=10)
            finally:
                await asyncio.gather(*(s.shutdown() for s in sybils))

    seconds, busy = asyncio.run(go())
    assert seconds < 10


def test_peers_that_claim_the_version_and_never_serve_it_delay_a_node_only_for_the_patience(tmp_path):
    """Sybils take the trainer's copies of version 1 and claim holding it (true enough) but
    serve nothing: the honest node is turned away to fetch from them, fails there, and is let
    in by the trainer after `patience` seconds whatever they claim."""
    async def go():
        async with LiveService(tmp_path, budget=UploadBudget(2, patience=3.0)) as coordinator:
            sybils = await sybils_fetch_then_claim(coordinator, claim=1)
            assert coordinator.presence.holding(1) == 2
            try:
                return await honest_catch_up(coordinator, [s.peer_id for s in sybils], within=12)
            finally:
                await asyncio.gather(*(s.shutdown() for s in sybils))

    seconds, busy = asyncio.run(go())
    assert busy > 0 and seconds >= 2.5, (seconds, busy)  # turned away while the claims stood, then let in


def test_a_volunteers_node_uploads_within_its_budget_whoever_asks(tmp_path, tiny_model):
    """A real node serves its base model file to peers. Fresh peer ids (each a new asker to
    whom nothing was sent yet) pull it again and again: together they get the node's burst and
    its rate (the defaults: 32 MiB, 8 MiB/s), then `busy`, each of them."""
    done = False
    coordinator = HostileCoordinator(model=tiny_model, lease=lambda request: NoWork(
        latest_version=0, retry_after=0.2, finished=done))
    size = tiny_model.stat().st_size
    stop_at = 200 * MIB  # an unbudgeted node would serve it all

    async def go():
        nonlocal done
        async with coordinator:
            joining = asyncio.ensure_future(coordinator.join(tmp_path / "node", "--model", str(tiny_model),
                                                             timeout=120))
            async with asyncio.timeout(90):
                while not coordinator.requests:  # the node asks for work once it serves its base
                    assert not joining.done(), joining.result()
                    await asyncio.sleep(0.2)
            node = coordinator.requests[0].peer_id
            askers = await Peer.many(coordinator.address, 3)
            served, refused = [0] * len(askers), [0] * len(askers)
            request = ChunkRequest(coordinator.listed.chunks).to_wire()

            async def pull(i: int) -> None:
                while not refused[i] and sum(served) < stop_at:
                    try:
                        for reply in await askers[i].endpoint.call(node, rpc.CHUNKS, request):
                            served[i] += len(reply.data)
                    except RemoteError as e:
                        assert e.code == "busy", e
                        refused[i] += 1
                    except TransportError:  # a fresh loopback stream now and then resets
                        pass

            try:
                started = time.monotonic()
                await asyncio.gather(*(pull(i) for i in range(len(askers))))
                seconds = time.monotonic() - started
            finally:
                await asyncio.gather(*(a.shutdown() for a in askers))
            done = True
            code, out = await joining
            return served, refused, seconds, code, out

    served, refused, seconds, code, out = asyncio.run(go())
    assert all(refused), f"served {sum(served) / MIB:.0f} MiB in {seconds:.1f} s and never said busy"
    # The burst and the rate over the time it took, and what was in flight (one file per asker).
    assert sum(served) <= 32 * MIB + 8 * MIB * seconds + len(served) * (size + 4096), (sum(served), seconds)
    assert code == 0 and "the run is finished" in out, out

"""What a node decides about a run before it does any work."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from echo_node.node import JoinRefused, Node, NodeConfig
from echo_node.updates import UpdateError
from protocols.errors import RemoteError, TransportError
from protocols import rpc
from protocols.messages import NoWork, PushReceipt, RolloutBatch, TaskSpec
from tests.support.envs import MoreE
from tests.unit.protocols import factories


def node_for(tmp_path, task: TaskSpec) -> Node:
    node = Node(NodeConfig(address="/ip4/127.0.0.1/tcp/1/p2p/Qm", run_key="a" * 26, model=tmp_path / "m.gguf",
                           data_dir=tmp_path / "node"))
    node.manifest = factories.manifest(task=task)
    return node


def test_multi_turn_runs_need_the_environment_here(tmp_path):
    node = node_for(tmp_path, TaskSpec("tests.support.envs:MoreE", {"max_turns": 2}, max_turns=2))
    assert node._load_task() == MoreE(max_turns=2)
    missing = node_for(tmp_path, TaskSpec("their_pkg.envs:Maze", {}, max_turns=3))
    with pytest.raises(JoinRefused, match="install the package that provides 'their_pkg.envs:Maze'"):
        missing._load_task()


@pytest.mark.parametrize("mode", ["async", "sequential"])
def test_a_node_moves_to_the_lease_version(tmp_path, mode):
    """Async too: the newest version whenever it can, not only when S behind."""
    node = node_for(tmp_path, TaskSpec("arithmetic", {}, max_turns=1))
    node.manifest = factories.manifest(mode=mode, staleness=4)
    node.version = 3

    async def bring_to(version):
        node.version = version

    node._bring_to = bring_to
    asyncio.run(node._prepare(factories.lease(version=5)))
    assert node.version == 5


@pytest.mark.parametrize("mode, held, latest, fails", [
    ("async", 3, 5, False),  # within the bound: sample with version 3 rather than lose the lease
    ("async", 1, 5, True),  # 4 behind with S = 4: must update
    ("sequential", 4, 5, True),  # sequential pull needs exactly the lease's version
])
def test_a_failed_update_is_fatal_only_outside_the_bound(tmp_path, mode, held, latest, fails):
    node = node_for(tmp_path, TaskSpec("arithmetic", {}, max_turns=1))
    node.manifest = factories.manifest(mode=mode, staleness=4)
    node.version = held

    async def bring_to(version):
        raise UpdateError("no provider answered")

    node._bring_to = bring_to
    if fails:
        with pytest.raises(UpdateError):
            asyncio.run(node._prepare(factories.lease(version=latest)))
    else:
        asyncio.run(node._prepare(factories.lease(version=latest)))
        assert node.version == held


class FlakyTrainer:
    """An endpoint whose pushes fail with the given errors, then succeed."""

    def __init__(self, *errors):
        self.errors, self.calls = list(errors), 0

    async def call_one(self, peer, handler, payload):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return PushReceipt(accepted=4, rejected=0, reasons={}, latest_version=2).to_wire()


def test_a_push_is_retried_across_a_broken_stream_but_not_after_a_refusal(tmp_path, monkeypatch):
    monkeypatch.setattr("protocols.supervise.Backoff.next", lambda self: 0.0)
    node = node_for(tmp_path, TaskSpec("arithmetic", {}, max_turns=1))
    node.trainer, batch, lasts = "trainer", factories.batch(), time.time() + 60
    node.endpoint = FlakyTrainer(TransportError("stream broke"), TransportError("connection refused"))
    assert asyncio.run(node._push(batch, lasts)).accepted == 4 and node.endpoint.calls == 3
    # A refusal is the trainer's answer: pushing the same batch again is refused again (a node
    # that kept at it held a dead lease until it expired, and missed the end of the run).
    node.endpoint = FlakyTrainer(RemoteError("stale", "batch of version 3 refused at version 6", "p", "echo.push"))
    with pytest.raises(RemoteError, match="stale"):
        asyncio.run(node._push(batch, lasts))
    assert node.endpoint.calls == 1
    # A broken stream past the lease's expiry is given up.
    node.endpoint = FlakyTrainer(TransportError("stream broke"))
    with pytest.raises(TransportError, match="stream broke"):
        asyncio.run(node._push(batch, time.time()))


class SlowTrainer:
    """Hands out `leases` leases, then says the run is over; answers each push after `seconds`,
    refusing the first as stale. Records what happened when."""

    peer_id = "QmNode"

    def __init__(self, leases: int, seconds: float):
        self.left, self.seconds, self.events, self.pushing, self.most_pushing = leases, seconds, [], 0, 0

    async def call_one(self, peer, handler, payload):
        if handler == rpc.LEASE:
            if self.left == 0:
                return NoWork(latest_version=0, retry_after=0.0, finished=True).to_wire()
            self.left -= 1
            return factories.lease(lease_id=f"L{self.left}", version=0, expires_at=time.time() + 60).to_wire()
        lease_id = RolloutBatch.from_wire(payload).lease_id
        self.pushing += 1
        self.most_pushing = max(self.most_pushing, self.pushing)
        await asyncio.sleep(self.seconds)
        self.pushing -= 1
        self.events.append(("answered", lease_id))
        if lease_id == "L2":
            raise RemoteError("stale", "batch of version 0 refused at version 4", "p", "echo.push")
        return PushReceipt(accepted=2, rejected=0, reasons={}, latest_version=0).to_wire()


def test_a_push_overlaps_the_next_generation_and_one_refusal_does_not_stop_the_node(tmp_path):
    node = node_for(tmp_path, TaskSpec("arithmetic", {}, max_turns=1))
    node.manifest = factories.manifest(mode="async")
    node.trainer, node.endpoint = "trainer", SlowTrainer(leases=3, seconds=0.3)
    node.backend = SimpleNamespace(name="llama.cpp", throughput=0.0)
    finished = []

    def generate(lease):
        node.endpoint.events.append(("generate", lease.lease_id))
        time.sleep(0.2)
        return factories.batch(lease_id=lease.lease_id, version=0)

    async def prepare(lease):
        pass

    async def finish(version):
        finished.append(list(node.endpoint.events))

    node._generate, node._prepare, node._finish = generate, prepare, finish
    node._say = lambda event: None

    async def run():
        announcer = asyncio.create_task(asyncio.sleep(60))
        await node._work_loop(announcer)
        announcer.cancel()

    asyncio.run(run())
    events = node.endpoint.events
    # L1 is generated while L2's push is being answered, L0 while L1's; never two pushes at once.
    assert events == [("generate", "L2"), ("generate", "L1"), ("answered", "L2"), ("generate", "L0"),
                      ("answered", "L1"), ("answered", "L0")]
    assert node.endpoint.most_pushing == 1
    assert node.accepted == 4  # L1 and L0; the refused L2 is only logged
    assert finished == [events]  # the run ends once the last push is answered

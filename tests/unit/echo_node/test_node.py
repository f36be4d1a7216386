"""What a node decides about a run before it does any work."""

import asyncio

import pytest

from echo_node.node import JoinRefused, Node, NodeConfig
from echo_node.updates import UpdateError
from protocols.messages import TaskSpec
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

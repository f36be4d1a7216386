"""What a node decides about a run before it does any work."""

import pytest

from echo_node.node import JoinRefused, Node, NodeConfig
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

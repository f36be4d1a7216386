"""What `--help` prints: square brackets survive, tasks and modes are listed."""

import pytest
from typer.testing import CliRunner

from echo_coordinator.cli import app as coordinator
from echo_node.cli import app as node


@pytest.mark.parametrize("command", [["start"], ["status"], ["dashboard"], []])
def test_coordinator_help(command):
    out = CliRunner().invoke(coordinator, [*command, "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    if command == ["start"]:
        text = " ".join(out.output.split())
        assert "run.toml with [run] and [trainer] tables" in text
        assert "arithmetic, kk, math, sokoban" in text and "sequential" in text and "async" in text
        assert "--no-dashboard" in text and "--verbose" in text


def test_node_help():
    out = CliRunner().invoke(node, ["join", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "--verbose" in out.output and "llama_cpp" in out.output

"""What `--help` prints: square brackets survive, tasks and modes are listed."""

import json

import pytest
from typer.testing import CliRunner

from echo_coordinator.plot import read_metrics
from echo_coordinator.cli import app as coordinator
from echo_node.cli import app as node


@pytest.mark.parametrize("command", [["start"], ["status"], ["dashboard"], ["eval"], ["plot"], []])
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


def step(version: int, **kw) -> dict:
    return dict(version=version, mode="async", samples=8, reward_mean=0.1 * version, step_seconds=2.0, time=10.0 + version,
                staleness_max=1, staleness_histogram={"0": 4, "1": 4}, **kw)


def test_plot_writes_a_png_of_steps_and_evaluations(tmp_path):
    records = [step(0), {"eval_version": 0, "eval_sampling": "greedy", "eval_accuracy": 0.2, "eval_complete": True},
               step(1), {"eval_version": 1, "eval_sampling": "greedy", "eval_accuracy": 0.9, "eval_complete": False}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"version": 2, "rew')
    steps, evals = read_metrics(tmp_path)
    assert [s["version"] for s in steps] == [0, 1]  # the line being written is not read
    assert [e["eval_version"] for e in evals] == [0]  # an incomplete round is no point of the curve
    out = CliRunner().invoke(coordinator, ["plot", "--data-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = CliRunner().invoke(coordinator, ["plot", "--data-dir", str(tmp_path / "nowhere")])
    assert missing.exit_code == 1 and "no metrics" in missing.output


def test_eval_needs_a_run(tmp_path):
    out = CliRunner().invoke(coordinator, ["eval", "--data-dir", str(tmp_path), "--version", "0"])
    assert out.exit_code == 1 and "config.json" in out.output

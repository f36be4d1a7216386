"""A closed run: only listed node keys may work; any other node is told why and exits."""

from __future__ import annotations

import subprocess
import sys

from tests.support.runs import VENV_BIN, join_argv, spawn, write_config


def test_a_node_not_on_the_allow_list_is_refused_with_its_fingerprint(tmp_path, tiny_model, processes):  # noqa: F811
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", tiny_model, run_dir, task="arithmetic", steps=1)
    allowed = tmp_path / "keys.txt"
    allowed.write_text("# the volunteers we know\n" + "a" * 26 + "\n")
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config),
                                    "--allow-keys", str(allowed)], tmp_path / "coordinator.log")
    argv = join_argv(run_dir, coordinator)
    out = subprocess.run([str(VENV_BIN / argv[0]), *argv[1:], "--data-dir", str(tmp_path / "n"), "--threads", "1"],
                         capture_output=True, text=True, timeout=180)
    text = " ".join(out.stdout.split())
    assert out.returncode == 3, text[-2000:]
    assert "admits only listed node keys" in text
    node_key = text.split("(node key ")[1].split(")")[0]
    assert node_key in text.split("admits only listed node keys")[1]  # the fingerprint to send the operator

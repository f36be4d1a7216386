"""A node's settings are checked when made, with messages that say how to fix them; the CLI
reports them as usage errors."""

import pytest
from typer.testing import CliRunner

from echo_node.cli import app
from protocols.errors import ConfigError
from tests.unit.echo_node.conftest import ADDRESS, config


def test_a_valid_config_is_kept_as_given(tmp_path):
    made = config(tmp_path, backend="transformers", threads=2)
    assert (made.address, made.run_key, made.backend, made.threads) == (ADDRESS, "a" * 26, "transformers", 2)


@pytest.mark.parametrize("field, value, message", [
    ("run_key", "abc", "--run-key must be the 26-character fingerprint the coordinator printed"),
    ("run_key", "a" * 25 + "!", "--run-key must be"),
    ("backend", "vllm", "--backend must be llama_cpp or transformers, got 'vllm'"),
    ("address", "/ip4/127.0.0.1/tcp/1", "ending in /p2p/<peer id>"),
    ("address", "/ip4/127.0.0.1/tcp/1/p2p/QmCut", "ending in /p2p/<peer id>"),  # a copy cut short
    ("parallel", 0, "--parallel must be between 1 and 1024, got 0"),
    ("parallel", 4096, "--parallel must be between 1 and 1024, got 4096"),
])
def test_a_wrong_setting_says_how_to_fix_it(tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path, **{field: value})


def test_the_cli_reports_a_wrong_setting_as_a_usage_error(tmp_path):
    out = CliRunner().invoke(app, ["join", ADDRESS, "--run-key", "abc", "--data-dir", str(tmp_path)],
                             env={"COLUMNS": "200"})
    assert out.exit_code == 2
    assert "--run-key must be the 26-character fingerprint" in out.output
    assert not (tmp_path / "node.key").exists()  # nothing started

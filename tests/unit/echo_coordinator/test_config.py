from importlib import resources
from pathlib import Path

import pytest

from echo_coordinator.config import RunConfig, TrainerConfig, from_tables, load_config, to_tables
from protocols.errors import ConfigError
from protocols.errors import EchoError


def test_every_shipped_config_parses():
    shipped = [p for p in (resources.files("echo_coordinator") / "configs").iterdir() if p.name.endswith(".toml")]
    assert shipped
    for path in shipped:
        run, trainer = load_config(path)
        assert isinstance(run, RunConfig) and isinstance(trainer, TrainerConfig)


def test_overrides_apply_and_none_means_keep(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nsteps = 5\nmode = "async"\n[trainer]\nlora_rank = 8\n')
    run, trainer = load_config(path, steps=7, port=None, learning_rate=1e-3)
    assert (run.steps, run.mode, run.port, trainer.lora_rank, trainer.learning_rate) == (7, "async", 31337, 8, 1e-3)


@pytest.mark.parametrize("text, match", [
    ('[run]\nmode = "turbo"\n', "mode must be one of sequential, async"),
    ("[run]\ngroup_size = 1\n", "GRPO needs a group"),
    ("[run]\nstepz = 3\n", r"unknown field\(s\) \['stepz'\]"),
    ("[runn]\n", "unknown table"),
    ('[trainer]\nlora_init = "ones"\n', "lora_init"),
    ('[trainer]\ndevice = "gpu"\n', "device must be auto, cpu, cuda or cuda:N"),
    ('[run]\nsteps = "ten"\n', "steps"),
    ("[run\n", "cannot read config"),
    ('[run]\nmode = "async"\nstaleness = 2\nlag = 2\n', r"lag must be 0..staleness - 1 \(1\), got 2"),
    ("[run]\nlag = 1\n", "lag needs mode = \"async\" and eval_every = 0"),
    ('[run]\nmode = "async"\nlag = 1\neval_every = 2\n', "lag needs mode = \"async\" and eval_every = 0"),
    ('[trainer]\nobjective = "ppo"\n', "objective must be one of tis, icepop, m2po, got 'ppo'"),
    ("[trainer]\nicepop_low = 1.5\n", "icepop_low, icepop_high must be 0 < low < 1 < high, got 1.5 and 5.0"),
    ("[trainer]\nm2_threshold = 0\n", "m2_threshold must be positive"),
])
def test_bad_configs_say_what_to_fix(tmp_path, text, match):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")


def test_one_strict_reader_for_toml_and_a_saved_config(tmp_path):
    run, trainer = RunConfig(steps=3, task_params={"digits": 1}), TrainerConfig(learning_rate=1e-3)
    assert from_tables(to_tables(run, trainer), None) == (run, trainer)
    saved = to_tables(run, trainer)
    saved["trainer"]["lora_rnak"] = 4
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['lora_rnak'\] in config.json") as e:
        from_tables(saved, Path("config.json"))
    assert isinstance(e.value, EchoError)  # the CLI's eval and export report it as an error line
    with pytest.raises(ConfigError, match="unknown table"):
        from_tables({"run": {}, "extra": {}}, None)
    with pytest.raises(ConfigError, match="steps must be a int"):
        from_tables({"run": {"steps": 2.5}}, None)

from importlib import resources

import pytest

from echo_coordinator.config import ConfigError, RunConfig, TrainerConfig, load_config


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
])
def test_bad_configs_say_what_to_fix(tmp_path, text, match):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")

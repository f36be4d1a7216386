"""The trainer under the oldest releases pyproject.toml declares: a LoRA and a full step,
verification (a group's prompt through the KV cache), the step verifying its own batch, routing
flips of a mixture of experts, the memory plan's counts, run by pytest in `.venv-floor` (`make
floor`: transformers, peft, gguf, numpy and numba at their floors, setup/floor.in). And an older transformers
is refused at start in one line."""

import importlib.metadata
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from engines.hf import FLOORS, check_versions
from protocols.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FLOOR_PYTHON = ROOT / ".venv-floor" / "bin" / "python"
TESTS = ["tests/unit/echo_coordinator/trainer/test_learner.py", "tests/unit/echo_coordinator/trainer/test_grpo.py",
         "tests/unit/echo_coordinator/trainer/test_step_checks.py", "tests/unit/echo_coordinator/trainer/test_routing.py",
         "tests/unit/echo_coordinator/test_memory_plan.py::test_parameter_counts_are_the_real_models"]


def declared() -> dict[str, str]:
    """Package -> the floor version pyproject.toml declares."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {m[1]: m[2] for m in (re.match(r"([\w-]+)>=([\d.]+)", d) for d in deps) if m}


def test_the_floor_venv_holds_the_declared_floors():
    assert FLOOR_PYTHON.exists(), "no .venv-floor: `make floor` builds it (`make test` does)"
    pins = re.findall(r"^([\w-]+)==(\S+)$", (ROOT / "setup" / "floor.in").read_text(), re.M)
    pinned = dict(pins)
    floors = declared()
    for package in ("transformers", "peft", "gguf", "numpy", "numba"):
        assert pinned[package].startswith(floors[package]), (package, pinned[package], floors[package])
    for package, floor in FLOORS.items():  # the start-up refusal and pyproject say the same
        assert floors[package] == ".".join(map(str, floor))


def test_a_step_and_verification_run_under_the_declared_floors():
    found = subprocess.run([str(FLOOR_PYTHON), "-c", "import importlib.metadata as m; print(m.version('transformers'), "
                            "m.version('peft'))"], capture_output=True, text=True, check=True).stdout.split()
    assert found == [declared()["transformers"] + ".0", declared()["peft"] + ".0"]
    run = subprocess.run([str(FLOOR_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", run.stdout) and "failed" not in run.stdout.splitlines()[-1]


def test_an_older_transformers_is_refused_in_one_line(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "4.56.0" if p == "transformers" else real(p))
    with pytest.raises(ConfigError, match=r"^transformers 4\.56\.0 is installed; echo-swarm's trainer needs "
                                          r"transformers >= 5\.0 \(pip install -U 'transformers>=5\.0'\)$"):
        check_versions()

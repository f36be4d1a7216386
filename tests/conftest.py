"""Shared test settings and fixtures. Hypothesis runs at least 200 examples per property.

Fixtures for tests that start real processes (`processes`, `tiny_model`); the plain helpers
they use (spawn, wait_for, free ports, run configurations) are in tests/support/runs.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.tiny_model import build_tiny_gguf

settings.register_profile("echo", max_examples=200, deadline=None)
settings.load_profile("echo")


@pytest.fixture
def processes():
    """Processes a test starts (`runs.spawn`): stopped at the end, only ours, by handle."""
    from echo_coordinator.demo import stop

    started: list[subprocess.Popen] = []
    yield started
    stop(started)


@pytest.fixture(scope="session", autouse=True)
def echo_cache(tmp_path_factory) -> Path:
    """One cache of derived files (`engines.hf.cache_dir`) for the session and every process it
    starts: a GGUF's checkpoint is converted once per session, not once per process, and the
    user's own cache is left alone."""
    path = tmp_path_factory.mktemp("echo-cache")
    os.environ["ECHO_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama GGUF with a real tokenizer, built once per session (read-only: runs
    copy what they change)."""
    return build_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")

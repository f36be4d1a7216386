"""bench/gpu_check.py: the one command a GPU session runs. `--quick` runs every part on the CPU with
tiny shapes, so the command a GPU session gets is known to work before the GPU time is spent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def test_quick_runs_every_part_and_reports_each(tmp_path):  # about 50 s: five processes on tiny models
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--quick", "--out", str(tmp_path),
                           "--minutes", "6"], capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((tmp_path / "report.json").read_text())["parts"]
    assert {name: row["status"] for name, row in parts.items()} == dict.fromkeys(gpu_check.SHARES, "ok")
    assert json.loads(done.stdout.splitlines()[-1]) == dict.fromkeys(gpu_check.SHARES, "ok")
    env = parts["env"]["results"][-1]
    assert env["torch"] and env["cuda_available"] is False and "llama_system_info" in env
    node = parts["node"]["results"][-1]["summary"]
    # The CPU's one setting. The node's backend near raw batched (0.47-0.83 on this tiny model, whose
    # steps are mostly the sampler's; 0.1 leaves room for a busy machine): 0.04 when the bench timed
    # numba's first compile.
    assert set(node) == {"f32"} and node["f32"]["backend_over_raw_batched@8"] > 0.1
    honest = parts["honest"]["results"][-1]
    assert honest["honest_samples"] == 4 and honest["false_rejections"] == 0
    # Every cheat of the version caught, but the concentrated one: its every 40th token shaded is
    # 2 or 3 tokens in a 4-sample batch, within the rule's allowance of 3 + 1 % (docs/verification.md).
    caught = {name: rate for name, rate in honest["detection"].items() if not name.startswith("2.5 % of tokens")}
    assert len(caught) == 8 and all(rate == 1.0 for rate in caught.values()), honest["detection"]


@pytest.mark.parametrize("code, status", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed (SIGSEGV)"),
    ("import sys; print('{\"partial\": 1}', flush=True); sys.exit(3)", "failed (exit 3)"),
    ("import time; print('{\"partial\": 2}', flush=True); time.sleep(60)", "timeout (2 s)"),
])
def test_a_part_that_crashes_fails_or_hangs_is_a_row_with_what_it_printed(tmp_path, code, status):
    row = gpu_check.run_part("part", [sys.executable, "-c", code], 2.0, tmp_path)
    assert row["status"] == status
    if "partial" in code:
        assert row["results"][0]["partial"] in (1, 2)
    assert (tmp_path / "part.log").exists()

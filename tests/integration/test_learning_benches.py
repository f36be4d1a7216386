"""bench/learning.py and bench/staleness.py: their `--quick` runs end to end (real swarms of 2 nodes,
the reference loop, the batched evaluation), on the tiny model, so the hours they stand for are
known to work before they are spent. The staleness run is also the real-run test of staleness on
demand (`[run] lag`, docs/protocols.md)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.support.runs import metrics

ROOT = Path(__file__).resolve().parents[2]


def quick(bench: str, tmp_path: Path, model: Path) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--quick", "--model", str(model),
                           "--keep", str(tmp_path), "--plot", str(tmp_path / "curves.png")],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    return json.loads(done.stdout.splitlines()[-1])


def test_learning_quick_trains_both_sides_on_the_same_samples(tmp_path, tiny_model):
    out = quick("learning.py", tmp_path, tiny_model)
    assert {"parity_last", "parity_mean", "seed_spread", "task"} <= set(out)
    assert out["versions"] == [0, 4] and out["samples_per_version"] == 8
    assert [len(c) for c in out["curves"]["swarm"] + out["curves"]["reference"]] == [2, 2]
    # The swarm's trainer took each version's 8 samples on-policy; the reference kept its figures.
    steps = metrics(tmp_path / "swarm-seed1")
    assert [s["samples"] for s in steps] == [8] * 4 and all(s["staleness_max"] == 0 for s in steps)
    assert json.loads((tmp_path / "reference-seed1.json").read_text()).keys() == {"0", "4"}


def test_staleness_quick_trains_every_sample_as_old_as_asked(tmp_path, tiny_model):
    out = quick("staleness.py", tmp_path, tiny_model)
    assert {"heldout_ratio_s4", "heldout_ratio_s8", "seed_spread", "objective"} <= set(out)
    assert set(out["runs"]) == {"tis S=0", "tis S=2"}
    assert out["runs"]["tis S=0"][0]["age_max"] == 0
    # At lag 2 (bound S = 3) leases bind the version 2 before the trainer's: a step at version v
    # trains on samples min(v, 2) versions old or older, and none older than 3.
    steps = metrics(tmp_path / "tis-s2-seed1")
    assert [s["version"] for s in steps] == [0, 1, 2, 3] and all(s["samples"] == 8 for s in steps)
    ages = [sorted(int(age) for age in s["staleness_histogram"]) for s in steps]
    assert all(a[0] >= min(s["version"], 2) and a[-1] <= 3 for a, s in zip(ages, steps)), ages
    assert [len(out["runs"]["tis S=2"][0][k]) for k in ("mismatch_kl", "cut", "log_ratio_m2")] == [4, 4, 4]

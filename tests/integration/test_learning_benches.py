"""bench/learning.py and bench/staleness.py: their `--quick` runs end to end (real swarms of 2 nodes
on the shipped model, the reference loop, the batched evaluation), so the long runs they stand for
are known to work before their hour is spent."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick(bench: str, tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--quick", "--keep", str(tmp_path),
                           "--plot", str(tmp_path / "curves.png")], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    return json.loads(done.stdout.splitlines()[-1])


def test_learning_quick_trains_both_sides_on_the_same_samples(tmp_path):
    out = quick("learning.py", tmp_path)
    assert out["versions"] == [0, 4] and out["samples_per_version"] == 8
    assert [len(c) for c in out["curves"]["swarm"] + out["curves"]["reference"]] == [2, 2]
    # The swarm's trainer saw each version's 8 samples, leased for that version's seeds.
    steps = [json.loads(line) for line in (tmp_path / "swarm-seed1" / "metrics.jsonl").read_text().splitlines()]
    assert [s["samples"] for s in steps] == [8] * 4 and all(s["staleness_max"] == 0 for s in steps)
    assert {"parity_last", "parity_mean", "seed_spread", "task"} <= set(out)


def test_staleness_quick_trains_every_sample_as_old_as_asked(tmp_path):
    out = quick("staleness.py", tmp_path)
    assert set(out["runs"]) == {"tis S=0", "tis S=2"}
    assert out["runs"]["tis S=0"][0]["age_max"] == 0
    lagged = out["runs"]["tis S=2"][0]
    # 4 versions at lag 2, bound 3: versions 0 and 1 can only train on version 0's rollouts (ages 0
    # and 1), versions 2 and 3 on rollouts 2 or 3 versions old.
    assert lagged["age_max"] <= 3 and lagged["age_mean"] >= (0 + 1 + 2 + 2) / 4
    assert len(lagged["log_ratio_m2"]) == 4 and all(m >= 0 for m in lagged["log_ratio_m2"])
    assert {"heldout_ratio_s4", "heldout_ratio_s8", "seed_spread", "objective"} <= set(out)

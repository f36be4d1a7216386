"""bench/learning.py's `--quick` run end to end (a real swarm of 2 nodes, the reference loop, the
batched evaluation), on the tiny model, so the hours it stands for are known to work before they
are spent. (bench/staleness.py's is in test_staleness_bench.py: a module a worker, they run side by side.)"""

import json

from tests.support.runs import metrics, quick_bench


def test_learning_quick_trains_both_sides_on_the_same_samples(tmp_path, tiny_model):
    out = quick_bench("learning.py", tmp_path, tiny_model)
    assert {"parity_last", "parity_mean", "seed_spread", "task"} <= set(out)
    assert out["versions"] == [0, 4] and out["samples_per_version"] == 8
    assert [len(c) for c in out["curves"]["swarm"] + out["curves"]["reference"]] == [2, 2]
    # The swarm's trainer took each version's 8 samples on-policy; the reference kept its figures.
    steps = metrics(tmp_path / "swarm-seed1")
    assert [s["samples"] for s in steps] == [8] * 4 and all(s["staleness_max"] == 0 for s in steps)
    assert json.loads((tmp_path / "reference-seed1.json").read_text()).keys() == {"0", "4"}

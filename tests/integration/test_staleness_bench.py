"""bench/staleness.py's `--quick` run end to end (real swarms of 2 nodes, the batched evaluation),
on the tiny model. It is also the real-run test of staleness on demand (`[run] lag`,
docs/protocols.md)."""

from tests.support.runs import metrics, quick_bench


def test_staleness_quick_trains_every_sample_as_old_as_asked(tmp_path, tiny_model):
    out = quick_bench("staleness.py", tmp_path, tiny_model)
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

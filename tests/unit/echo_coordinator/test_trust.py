"""The trust rule: strikes and the bans they bring, the outlier budget, which batches are checked.
Pure functions over a key's record; the ledger stores it (test_ledger)."""

import pytest

from echo_coordinator import trust
from echo_coordinator.trust import BanRule, OutlierBudget, SpotCheck, Trust

BANS, BUDGET = BanRule(first=60, longest=1000), OutlierBudget(first=3, every=1000)


def test_bans_double_with_each_strike_up_to_a_cap():
    assert [BANS.seconds(k) for k in range(6)] == [0, 60, 120, 240, 480, 960]
    assert BANS.seconds(7) == 1000


def test_a_strike_bans_from_now_and_never_shortens_a_ban():
    first = trust.struck(Trust(verified=3), BANS, now=100.0)
    assert (first.failed, first.banned_until) == (1, 160.0) and first.banned(159.0) and not first.banned(160.0)
    second = trust.struck(first, BANS, now=110.0)
    assert (second.failed, second.banned_until) == (2, 230.0)  # 120 s from now
    passed = trust.verified(second, samples=16)
    assert (passed.verified, passed.samples, passed.banned_until) == (4, 16, 230.0)  # the ban stands
    long_ban = Trust(failed=9, banned_until=5000.0)
    assert trust.struck(long_ban, BANS, now=0.0).banned_until == 5000.0


def test_each_verdict_does_what_the_rule_says():
    key = Trust(verified=2, samples=32)
    assert trust.judged(key, None, 8, BANS, BUDGET, 0.0) == Trust(verified=3, samples=40)
    assert trust.judged(key, "unverifiable", 8, BANS, BUDGET, 0.0) == key  # the trainer's fault, not the key's
    for reason in ("bad_sampling", "bad_logprobs", "truncated"):
        assert trust.judged(key, reason, 8, BANS, BUDGET, 0.0).failed == 1
    outliers = [key]
    for _ in range(4):
        outliers.append(trust.judged(outliers[-1], "outlier", 8, BANS, BUDGET, 0.0))
    assert [t.outliers for t in outliers[1:]] == [1, 2, 3, 4]
    assert [t.failed for t in outliers[1:]] == [0, 0, 0, 1]  # struck from the fourth


def test_a_keys_outlier_budget_runs_ahead_of_honest_keys_only():
    assert [BUDGET.strikes(0, n) for n in (1, 2, 3, 4)] == [False, False, False, True]
    assert not BUDGET.strikes(1000, 4) and BUDGET.strikes(1999, 5) and not BUDGET.strikes(5000, 8)
    # Honest keys: 4 outliers in 20,512 calibration samples. Over a long honest history at that
    # rate, the budget is never exceeded; a key writing one answer in every 300 samples is struck.
    honest = [BUDGET.strikes(n, 1 + n * 4 // 20_512) for n in range(0, 200_000, 16)]
    writer = [BUDGET.strikes(n, 1 + n // 300) for n in range(0, 200_000, 16)]
    assert not any(honest) and any(writer)


def test_spot_check_always_checks_new_and_failed_keys():
    spot = SpotCheck(fraction=0.1, trust_after=3)
    assert spot.should_check(Trust(), draw=0.99) and Trust().new
    assert spot.should_check(Trust(verified=100, failed=1), draw=0.99)
    assert not spot.should_check(Trust(verified=3), draw=0.5)
    assert spot.should_check(Trust(verified=3), draw=0.05)
    with pytest.raises(ValueError):
        SpotCheck(fraction=0)


def test_a_proven_key_has_enough_verified_batches_and_no_strike():
    """Where the step checks batches itself, only a proven key's wait for it (`service.policing`)."""
    assert Trust(verified=1).proven(1) and not Trust(verified=0).proven(1)
    assert not Trust(verified=50, failed=1).proven(1)

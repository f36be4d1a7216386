"""The capacity model's arithmetic and the throughput it is fed."""

import math

import pytest

from echo_coordinator.capacity import MAX_PUSHES, Throughput, plan


def test_async_nodes_bottleneck():
    cap = plan([1.0, 1.0], step_seconds=10.0, samples_per_step=64, mode="async", staleness=4, cycle_seconds=30.0)
    assert cap.produced == 2.0 and cap.needed == 6.4 and cap.bottleneck == "nodes"
    assert cap.more_nodes == 5  # ceil((6.4 - 2) / median 1.0)
    assert cap.predicted_busy == pytest.approx(2.0 / 6.4)
    assert cap.slack_seconds == 120.0  # S steps of 30 s


def test_async_trainer_bottleneck():
    cap = plan([5.0, 3.0], step_seconds=10.0, samples_per_step=64, mode="async", staleness=4)
    assert cap.bottleneck == "trainer" and cap.more_nodes == 0 and cap.predicted_busy == 1.0


def test_sequential_takes_turns():
    # 64 samples at 2/s take 32 s, then 10 s of training: busy 10 / 42, never 1.
    cap = plan([2.0], step_seconds=10.0, samples_per_step=64, mode="sequential", staleness=4)
    assert cap.predicted_busy == pytest.approx(10 / 42) and cap.slack_seconds is None
    fast = plan([1000.0], step_seconds=10.0, samples_per_step=64, mode="sequential", staleness=4)
    assert fast.bottleneck == "trainer" and 0.99 < fast.predicted_busy < 1.0


def test_median_node_sets_how_many_more():
    cap = plan([0.5, 1.0, 4.0], step_seconds=4.0, samples_per_step=64, mode="async", staleness=2)
    assert cap.more_nodes == math.ceil((16 - 5.5) / 1.0)


def test_unknown_until_measured():
    assert plan([1.0], None, 64, "async", 4).bottleneck == "unknown"
    cap = plan([], 10.0, 64, "async", 4)
    assert cap.bottleneck == "unknown" and cap.needed == 6.4 and cap.predicted_busy is None


def test_throughput_excludes_time_waiting_for_work():
    t = Throughput(window=1000)
    t.pushed("a", 16, issued=0.0, now=10.0)
    t.pushed("a", 16, issued=30.0, now=40.0)  # idle 10..30 waiting for a lease: not counted
    assert t.rate("a", now=41.0) == pytest.approx(32 / 20)
    t.pushed("a", 16, issued=35.0, now=50.0)  # leased before the last push landed: counted from it
    assert t.rate("a", now=51.0) == pytest.approx(48 / 30)
    assert t.rates(51.0) == {"a": pytest.approx(1.6)}


def test_throughput_window_and_bounded_memory():
    t = Throughput(window=60)
    t.pushed("a", 8, issued=0.0, now=4.0)
    assert t.rate("a", now=30.0) == 2.0 and t.rate("a", now=100.0) is None
    for i in range(MAX_PUSHES * 3):
        t.pushed("b", 1, issued=float(i), now=i + 1.0)
    assert len(t.pushes["b"]) == MAX_PUSHES
    t.forget("b")
    assert "b" not in t.pushes and t.rate("b", 10.0) is None


def test_update_delivery_time():
    t = Throughput()
    t.published_version(3, now=100.0)
    t.holds("a", 2, now=101.0)  # not yet
    t.holds("a", 3, now=103.0)
    t.holds("a", 3, now=110.0)  # same version again: counted once
    t.holds("b", 3, now=105.0)
    assert list(t.heard) == [3.0, 5.0] and t.update_seconds() == 4.0
    t.holds("c", 99, now=106.0)  # a version never published is not a delivery
    assert len(t.heard) == 2

"""A volunteer's hours and pause: when a node takes leases."""

from datetime import datetime

import pytest

from echo_node.config import NodeConfig
from echo_node.schedule import Hours, idle_reason, set_paused
from protocols.errors import ConfigError
from tests.unit.echo_node.conftest import ADDRESS


def at(hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 12, 5, hour, minute)


def test_hours_past_midnight_and_within_a_day():
    nights = Hours.parse("22-07")
    assert [nights.contain(at(h)) for h in (21, 22, 23, 0, 6)] == [False, True, True, True, True]
    assert not nights.contain(at(7)) and not nights.contain(at(12))
    office = Hours.parse("9:30-17:00")
    assert not office.contain(at(9, 29)) and office.contain(at(9, 30)) and office.contain(at(16, 59))
    assert not office.contain(at(17)) and str(office) == "09:30-17:00"
    assert all(Hours.parse("0-24").contain(at(h)) for h in range(24))  # the whole day


@pytest.mark.parametrize("text", ["22", "22-22", "25-07", "9:75-10", "nights", "22-07-09", ""])
def test_hours_that_do_not_read_as_start_end_are_refused(text):
    with pytest.raises(ValueError, match="--hours"):
        Hours.parse(text)


def test_a_config_with_bad_hours_is_refused_at_start():
    with pytest.raises(ConfigError, match="--hours must be START-END"):
        NodeConfig(address=ADDRESS, run_key="a" * 26, hours="late")


def test_idle_while_paused_or_outside_hours(tmp_path):
    nights = Hours.parse("22-07")
    assert idle_reason(None, tmp_path, at(12)) is None
    assert idle_reason(nights, tmp_path, at(23)) is None
    assert idle_reason(nights, tmp_path, at(12)) == "outside its hours (22:00-07:00); it goes on at 22:00"
    set_paused(tmp_path, True)
    assert idle_reason(None, tmp_path, at(12)).startswith("paused")
    assert idle_reason(nights, tmp_path, at(23)).startswith("paused")  # a pause holds within the hours too
    set_paused(tmp_path, False)
    set_paused(tmp_path, False)  # resuming twice is harmless
    assert idle_reason(None, tmp_path, at(12)) is None

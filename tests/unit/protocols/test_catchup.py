import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.catchup import Step, plan
from protocols.errors import InvalidValue


def deltas(upto: int, nbytes: int = 10) -> list[Step]:
    return [Step(v - 1, v, nbytes) for v in range(1, upto + 1)]


def test_late_joiner_takes_the_snapshot_when_cheaper():
    offered = deltas(50) + [Step(0, 40, 200, replaces=True)]
    chain = plan(3, 50, offered)
    assert chain[0] == Step(0, 40, 200, replaces=True) and [s.to_version for s in chain[1:]] == list(range(41, 51))
    assert plan(45, 50, offered) == deltas(50)[45:]  # close behind: deltas are cheaper
    assert plan(50, 50, offered) == []


def test_a_gap_is_an_error():
    with pytest.raises(InvalidValue, match="no chain"):
        plan(0, 5, deltas(3) + [Step(4, 5, 10)])


@given(st.integers(0, 30), st.integers(1, 30), st.integers(1, 500), st.integers(1, 10), st.integers(1, 8))
def test_chain_is_valid_and_no_costlier_than_pure_deltas(held, ahead, snapshot_bytes, delta_bytes, every):
    target = held + ahead
    offered = deltas(target, delta_bytes) + [
        Step(0, v, snapshot_bytes, replaces=True) for v in range(every, target + 1, every)
    ]
    chain = plan(held, target, offered)
    version = held
    for step in chain:  # every step applies where it is taken
        assert step.replaces or step.from_version == version
        version = step.to_version
    assert version == target
    assert sum(s.nbytes for s in chain) <= ahead * delta_bytes

"""Micro-batches bound the padded tokens of one forward/backward, whatever the sample lengths."""

from hypothesis import given
from hypothesis import strategies as st

from echo_coordinator.trainer.tensors import forward_batches, micro_batches


@given(st.lists(st.integers(1, 3000), max_size=60), st.integers(1, 8192))
def test_every_sample_once_and_padded_size_within_budget(lengths, budget):
    groups = micro_batches(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget


def test_similar_lengths_share_a_micro_batch():
    assert micro_batches([100, 1000, 120, 900], 2000) == [[1, 3], [2, 0]]
    assert micro_batches([5000], 4096) == [[0]]  # too long for the budget: alone, never dropped


@given(st.lists(st.integers(1, 600), min_size=1, max_size=60), st.integers(1, 8), st.integers(1, 8192))
def test_forward_batches_keep_every_group_whole_and_within_budget(lengths, group, budget):
    parts = [list(range(a, min(a + group, len(lengths)))) for a in range(0, len(lengths), group)]
    batches = forward_batches(parts, lengths, budget)
    assert [part for batch in batches for part in batch] == parts  # in order, none split or dropped
    for batch in batches:
        rows = [i for part in batch for i in part]
        assert len(batch) == 1 or len(rows) * max(lengths[i] for i in rows) <= budget

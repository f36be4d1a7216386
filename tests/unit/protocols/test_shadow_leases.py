"""Shadow leases (issue 36 point 2): a key that finds no seed it may take gets the seeds of
another key's short lease; whichever answers first completes them, and no seed is ever counted
twice or lost, whatever order leases are answered, released or left to expire in."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from protocols.errors import LeaseError
from protocols.leases import LeaseBook

TTL, SHORT = 40.0, 10.0  # a proven key's lease, and a new key's


def hoarded(seeds=(1, 2, 3, 4)) -> tuple[LeaseBook, str]:
    """A book whose every seed a hoarding key holds in a new key's short lease."""
    book = LeaseBook(TTL, hold=SHORT)
    book.add_seeds(seeds)
    return book, book.issue("hoarder", len(seeds), 0, now=0.0, ttl=SHORT, proven=False).lease_id


def test_a_new_key_shadows_a_hoarded_lease_and_its_answer_wins():
    book, held = hoarded()
    assert book.issue("newcomer", 4, 0, now=1.0, ttl=SHORT, proven=False) is None  # nothing pending
    shadow = book.shadow("newcomer", 4, 0, now=1.0, ttl=SHORT)
    assert shadow.seeds == (1, 2, 3, 4) and shadow.lease_id != held and shadow.expires_at == 11.0
    assert book.held_by("newcomer") == 1
    assert book.complete(shadow.lease_id, "newcomer", now=5.0) == shadow
    assert book.completed_count == 4 and not book.outstanding and book.pending_count == 0
    with pytest.raises(LeaseError, match="answered by another key"):
        book.complete(held, "hoarder", now=6.0)
    # Its holder's answer may still be judged, once, for its key's proof; never completing a seed.
    assert book.beaten(held, "someone") is None and book.beaten(held, "hoarder").seeds == (1, 2, 3, 4)
    book.drop_beaten(held)
    assert book.beaten(held, "hoarder") is None and book.completed_count == 4


def test_a_shadow_of_part_of_a_lease_puts_the_rest_back_first_for_proven_keys():
    """A new node asks for one prompt (its first lease): it shadows one seed of four; answered, the
    hoarder's lease closes and the other three go back to the front, held for proven keys."""
    book, held = hoarded()
    shadow = book.shadow("newcomer", 1, 0, now=1.0, ttl=SHORT)
    assert shadow.seeds == (1,)
    book.complete(shadow.lease_id, "newcomer", now=2.0)
    assert book.pending_seeds == (2, 3, 4) and book.completed_count == 1 and not book.outstanding
    assert book.leasable(now=3.0, proven=False) == 0 and book.leasable(now=3.0, proven=True) == 3


def test_a_shadow_spans_several_leases_up_to_the_count_asked():
    """Fresh keys lease one prompt each; a proven node that decodes eight at a time answers
    three of their leases in one batch, not one lease after another."""
    book = LeaseBook(TTL, hold=SHORT)
    book.add_seeds(range(4))
    held = [book.issue(f"fresh{i}", 1, 0, now=float(i), ttl=SHORT, proven=False).lease_id for i in range(4)]
    shadow = book.shadow("proven", 3, 0, now=5.0, ttl=TTL)
    assert shadow.seeds == (0, 1, 2)
    book.expire(now=10.5)  # fresh0's lease lapses: its seed is pending, and still the shadow's to answer
    book.complete(shadow.lease_id, "proven", now=10.8)
    assert [x.lease_id for x in book.outstanding] == held[3:] and book.pending_count == 0
    assert [book.beaten(x, f"fresh{i}") is not None for i, x in enumerate(held)] == [False, True, True, False]


def test_the_holder_answering_first_closes_the_shadow():
    book, held = hoarded()
    shadow = book.shadow("newcomer", 4, 0, now=1.0, ttl=SHORT)
    book.complete(held, "hoarder", now=2.0)
    with pytest.raises(LeaseError, match="answered by another key"):
        book.complete(shadow.lease_id, "newcomer", now=3.0)
    assert book.completed_count == 4 and not book.shadows
    assert book.beaten(shadow.lease_id, "newcomer") == shadow  # its answer may still prove its key


def test_a_shadow_outlives_the_lease_it_repeats_until_its_seeds_go_out_again():
    book, held = hoarded()
    shadow = book.shadow("newcomer", 4, 0, now=5.0, ttl=SHORT)
    book.expire(now=12.0)  # the hoarder's lapsed: its seeds are pending, held back for proven keys
    assert book.find(shadow.lease_id, 12.0) == shadow
    book.complete(shadow.lease_id, "newcomer", now=13.0)
    assert book.pending_count == 0 and book.completed_count == 4 and book.lapses("hoarder")[0] == 1
    # Had a proven key taken them first, the shadow would be answered by another key.
    book, held = hoarded()
    shadow = book.shadow("newcomer", 4, 0, now=5.0, ttl=SHORT)
    assert book.issue("proven", 4, 0, now=12.0).seeds == (1, 2, 3, 4)
    with pytest.raises(LeaseError, match="answered by another key"):
        book.complete(shadow.lease_id, "newcomer", now=13.0)


def test_what_may_be_shadowed():
    book = LeaseBook(TTL, hold=SHORT)
    book.add_seeds(range(6))
    book.issue("proven", 2, 0, now=0.0)  # a standard lease: a key that delivers is never shadowed
    book.issue("old", 2, 0, now=0.0, ttl=SHORT, proven=False)
    book.issue("young", 2, 1, now=1.0, ttl=SHORT, proven=False)
    assert book.shadow("old", 4, 1, now=2.0, ttl=SHORT).seeds == (4, 5)  # of its version only, never one's own
    assert book.shadow("old", 4, 2, now=2.0, ttl=SHORT) is None
    first, second = (book.shadow(f"new{i}", 4, 0, now=2.0, ttl=SHORT) for i in range(2))
    assert first.seeds == (2, 3) and second.seeds == (2, 3)  # the only short lease of version 0 left to shadow
    book.expire(now=12.5)  # every short lease and shadow has lapsed: each counts against its key
    assert [book.lapses(k)[0] for k in ("old", "young", "new0", "new1", "proven")] == [2, 1, 1, 1, 0]
    assert not book.shadows


def test_a_refused_shadow_is_released_and_the_seeds_stay_with_their_lease():
    book, held = hoarded()
    shadow = book.shadow("cheat", 4, 0, now=1.0, ttl=SHORT)
    book.release(shadow.lease_id, "cheat", now=2.0)
    assert [x.lease_id for x in book.outstanding] == [held] and book.pending_count == 0 and not book.shadows
    with pytest.raises(LeaseError, match="released"):
        book.complete(shadow.lease_id, "cheat", now=3.0)
    with pytest.raises(LeaseError, match="not outstanding"):
        book.release(shadow.lease_id, "cheat", now=3.0)


def test_shadows_are_bounded(monkeypatch):
    monkeypatch.setattr("protocols.leases.MAX_SHADOWS", 3)
    book, held = hoarded()
    shadows = [book.shadow(f"k{i}", 4, 0, now=1.0, ttl=SHORT) for i in range(5)]
    assert [x.lease_id for x in book.shadows] == [x.lease_id for x in shadows[2:]]
    with pytest.raises(LeaseError, match="too many shadow leases"):
        book.complete(shadows[0].lease_id, "k0", now=2.0)


def test_a_restored_book_counts_what_each_key_holds():
    book = LeaseBook(TTL)
    book.add_seeds(range(6))
    for key in ("a", "a", "b"):
        book.issue(key, 2, 0, now=0.0)
    again = LeaseBook.from_dict(book.to_dict())
    assert (again.held_by("a"), again.held_by("b"), again.held_by("c")) == (2, 1, 0)


KEYS = ("a", "b", "c", "d")


class ShadowMachine(RuleBasedStateMachine):
    """Any interleaving of short leases, shadows, answers, refusals and time: every seed stays in
    exactly one of pending / outstanding / completed, and no seed is completed twice."""

    @initialize(n=st.integers(1, 12))
    def setup(self, n):
        self.book, self.now = LeaseBook(TTL, hold=SHORT), 0.0
        self.book.add_seeds(range(n))
        self.added, self.completed, self.held = list(range(n)), [], []

    @rule(key=st.sampled_from(KEYS), count=st.integers(1, 4), proven=st.booleans())
    def lease(self, key, count, proven):
        lease = self.book.issue(key, count, 0, self.now, None if proven else SHORT, proven)
        if lease is None:
            lease = self.book.shadow(key, count, 0, self.now, SHORT)
        if lease is not None:
            self.held.append(lease)

    @rule(i=st.integers(0, 100))
    def answer(self, i):
        if not self.held:
            return
        lease = self.held.pop(i % len(self.held))
        try:
            done = self.book.complete(lease.lease_id, lease.node_id, self.now)
        except LeaseError:
            return
        self.completed += done.seeds

    @rule(i=st.integers(0, 100))
    def refuse(self, i):
        if self.held:
            lease = self.held.pop(i % len(self.held))
            try:
                self.book.release(lease.lease_id, lease.node_id, self.now)
            except LeaseError:
                pass

    @rule(dt=st.floats(0, 2 * SHORT))
    def tick(self, dt):
        self.now += dt
        self.book.expire(self.now)

    @invariant()
    def seeds_are_conserved(self):
        outstanding = [s for x in self.book.outstanding for s in x.seeds]
        assert Counter(self.book.pending_seeds) + Counter(outstanding) + Counter(self.completed) == Counter(self.added)
        assert self.book.completed_count == len(self.completed)

    @invariant()
    def what_each_key_holds_is_counted_as_it_comes_and_goes(self):
        # `held_by` is read per lease request: kept as a count, not a scan of every lease and
        # shadow (issue 55 point 8), it must still be what a scan finds, and keep no idle keys.
        held = Counter(x.node_id for x in (*self.book.outstanding, *self.book.shadows))
        assert all(self.book.held_by(key) == held[key] for key in KEYS)
        assert set(self.book._held) == set(held)


ShadowMachine.TestCase.settings = settings(max_examples=300, deadline=None, stateful_step_count=40)
TestShadows = ShadowMachine.TestCase

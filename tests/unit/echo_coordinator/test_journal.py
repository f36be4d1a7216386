"""The journal on real SQLite: what a restart recovers. Every accepted group is trained once and
credited once, whatever step a crash interrupts."""

from __future__ import annotations

import sqlite3
import threading
from contextlib import closing

import pytest

from echo_coordinator.journal import Group, Journal
from echo_coordinator.ledger import Ledger
from echo_coordinator.trainer.samples import TrainSample


def group(lease: str, seed: int, version: int = 0, node: str = "n1", samples: int = 2) -> Group:
    made = tuple(TrainSample((1, 2), (3, 4, 5), (-0.5, -0.25, -1.0), (1, 1, 1), reward=float(i), group=seed)
                 for i in range(samples))
    return Group(lease, seed, version, made, node, f"peer-{node}", node.upper(), tokens=3 * samples)


def test_accepted_groups_come_back_whole_after_a_restart(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    first, second = group("L1", 10), group("L2", 11, version=1, node="n2")
    journal.accept("L1", 0, [first], {"next_seed": 12}).result()
    journal.accept("L2", 1, [second], {"next_seed": 13, "leases": {"x": 1}}).result()
    ledger.close()

    recovered = Journal(Ledger(tmp_path / "ledger.sqlite")).recover(version=0)
    assert recovered.groups == [first, second]  # samples bit for bit, oldest first
    assert recovered.accepted == {"L1": 0, "L2": 1}
    assert recovered.values == {"next_seed": 13, "leases": {"x": 1, "outstanding": []}}  # the last save wins


def test_only_the_accepted_lease_ids_of_versions_the_gate_admits_are_read_back(tmp_path):
    """A long run accepts a lease id per push; a restart reads back only those the staleness
    rule still admits (older ones come back stale), and an older release's ids, whose versions
    it did not write, all of them."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.submit(ledger.db.executescript, "CREATE TABLE accepted (lease_id TEXT PRIMARY KEY);"
                                           "INSERT INTO accepted VALUES ('Old');").result()  # an older release's table
    journal = Journal(ledger)
    for version in range(5):
        journal.accept(f"L{version}", version, [group(f"L{version}", version, version)], {}).result()
    ledger.close()
    recovered = Journal(Ledger(tmp_path / "ledger.sqlite")).recover(version=4, oldest=3)
    assert recovered.accepted == {"Old": None, "L3": 3, "L4": 4}


def book(*leases: str) -> dict:
    """A lease book as `Leasing.book_state` gives it, with these leases outstanding."""
    return {"leases": {"ttl": 60, "next_id": len(leases), "pending": [7],
                       "outstanding": [[x, "node", [int(x[1:])], 0, 100.0, 40.0] for x in leases]}, "next_seed": 9}


def test_a_save_writes_only_the_leases_that_changed_and_a_restart_reads_the_whole_book(tmp_path):
    """A thousand volunteers hold a thousand leases, and every lease and push saves the book:
    each save writes the leases issued or closed since the last, not the whole book."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    journal.save(book("L1", "L2", "L3")).result()
    statements = []
    ledger.submit(ledger.db.set_trace_callback, statements.append).result()
    journal.accept("L2", 0, [group("L2", 2)], book("L1", "L3", "L4")).result()  # L2 answered, L4 issued
    ledger.submit(ledger.db.set_trace_callback, None).result()
    lease_rows = [x for x in statements if x.startswith(("DELETE FROM leases", "INSERT INTO leases"))]
    assert len(lease_rows) == 2 and "'L2'" in lease_rows[0] and "'L4'" in lease_rows[1], lease_rows
    # A save that fails writes nothing and forgets nothing: the next one still writes what changed.
    failing = book("L1", "L3", "L4", "L5")
    failing["next_seed"] = object()  # not JSON: the transaction rolls back after the lease rows
    try:
        journal.save(failing).result()
    except TypeError:
        pass
    else:
        raise AssertionError("an unserialisable value was saved")
    journal.save(book("L3", "L4", "L5")).result()
    ledger.close()

    again = Journal(Ledger(tmp_path / "ledger.sqlite"))
    recovered = again.recover(version=0)
    assert recovered.values == book("L3", "L4", "L5")  # in the order they were issued
    again.ledger.close()


def stored_book(path) -> list[str]:
    """The outstanding lease ids the file holds, read beside the ledger's thread (WAL readers do not wait)."""
    with closing(sqlite3.connect(path)) as db:
        return [row[0] for row in db.execute("SELECT lease_id FROM leases ORDER BY rowid")]


def test_a_save_rides_on_the_first_queued_accept_not_behind_the_queue(tmp_path):
    """A lease's save waits for the first queued write that starts after it, which commits the
    newest book given: not for a write of its own behind every other queued write."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    first, later = threading.Event(), threading.Event()
    ledger.submit(first.wait)  # the thread is busy
    accepted = journal.accept("L1", 0, [group("L1", 1)], book("L2"))
    ledger.submit(later.wait)  # and more work is queued behind the push's write
    saved = journal.save(book("L2", "L3"))  # a lease issued while both wait
    first.set()
    saved.result(timeout=10)  # done with the push's write, while the later work still waits
    assert accepted.done() and not later.is_set()
    assert stored_book(tmp_path / "ledger.sqlite") == ["L2", "L3"]  # the newest book, not the push's
    later.set()
    journal.save(book("L3")).result(timeout=10)  # nothing queued: a write of its own
    assert stored_book(tmp_path / "ledger.sqlite") == ["L3"]
    ledger.close()


def test_a_save_whose_waiter_gave_up_is_still_written_and_the_next_waiter_told(tmp_path):
    """The stream handler waits for a lease's save on its event loop; a stream that goes away
    cancels that wait, which must not cancel the save under the journal's feet."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    busy = threading.Event()
    ledger.submit(busy.wait)
    given_up, waited = journal.save(book("L1")), journal.save(book("L1", "L2"))
    assert not given_up.cancel()
    busy.set()
    waited.result(timeout=10)
    assert given_up.result(timeout=10) is None and stored_book(tmp_path / "ledger.sqlite") == ["L1", "L2"]
    ledger.close()


def test_a_save_that_rode_on_a_failed_accept_is_written_by_itself(tmp_path):
    """An accepted batch's write that fails (here a lease id accepted twice) takes no lease with it."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    journal.accept("L1", 0, [group("L1", 1)], book("L2")).result()
    busy = threading.Event()
    ledger.submit(busy.wait)
    again = journal.accept("L1", 0, [group("L1", 1)], book("L2"))
    saved = journal.save(book("L2", "L3"))
    busy.set()
    with pytest.raises(sqlite3.IntegrityError):
        again.result(timeout=10)
    saved.result(timeout=10)
    assert stored_book(tmp_path / "ledger.sqlite") == ["L2", "L3"]
    ledger.close()


def test_a_journal_of_an_older_release_with_the_whole_book_in_one_value_is_read(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    Journal(ledger)  # its tables
    ledger.submit(Journal._save_values, ledger.db, book("L1", "L2")).result()  # as releases before 2026-12-05 wrote it
    ledger.close()
    assert Journal(Ledger(tmp_path / "ledger.sqlite")).recover(version=0).values == book("L1", "L2")


def test_a_step_that_finished_is_credited_once_and_one_that_did_not_is_trained_again(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    a, b, c = group("L1", 1), group("L1", 2), group("L2", 3, node="n2")
    journal.accept("L1", 0, [a, b], {}).result()
    journal.accept("L2", 0, [c], {}).result()
    journal.take([a], step=0, dropped=[]).result()
    journal.commit_step(0).result()  # step 0 saved: a credited, gone from the buffer
    journal.take([b, c], step=1, dropped=[]).result()  # step 1 crashes before its state.json
    ledger.close()

    ledger = Ledger(tmp_path / "ledger.sqlite")
    recovered = Journal(ledger).recover(version=1)
    assert recovered.groups == [b, c]  # back in the buffer for the step to run again
    credited = {p["node_id"]: p["accepted"] for p in ledger.peers()}
    assert credited == {"n1": 2}  # a's two samples, once
    assert [h["version"] for h in ledger.history("n1")] == [1]


def test_a_crash_after_state_json_but_before_the_credits_is_finished_on_recovery(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    a = group("L1", 1)
    journal.accept("L1", 0, [a], {}).result()
    journal.take([a], step=0, dropped=[]).result()  # state.json names version 1; commit_step never ran
    ledger.close()

    ledger = Ledger(tmp_path / "ledger.sqlite")
    recovered = Journal(ledger).recover(version=1)
    assert recovered.groups == []
    assert {p["node_id"]: p["accepted"] for p in ledger.peers()} == {"n1": 2}
    assert Journal(ledger).recover(version=1).groups == []  # and never twice
    assert {p["node_id"]: p["accepted"] for p in ledger.peers()} == {"n1": 2}


def test_dropped_groups_leave_the_buffer_and_count_against_their_node(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    journal = Journal(ledger)
    old, fresh = group("L1", 1, samples=3), group("L2", 2)
    journal.accept("L1", 0, [old], {}).result()
    journal.accept("L2", 0, [fresh], {}).result()
    journal.take([fresh], step=4, dropped=[old]).result()
    assert ledger.rejection_totals() == {"stale": 3}
    assert Journal(ledger).recover(version=4).groups == [fresh]  # taken by the unfinished step 4
    ledger.close()

"""The contribution ledger on real SQLite: credits, rejections, evaluation credit, bans, history,
survival across a reopen, and metrics.jsonl rewound on a restart."""

from __future__ import annotations

import json
import threading

import pytest

from echo_coordinator import trust
from echo_coordinator.ledger import Ledger, MetricsLog
from echo_coordinator.trust import BanRule, OutlierBudget, Trust


def test_credits_rejections_and_evaluations_are_kept_apart_and_survive_a_reopen(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.credit("a", "peer-a", "alice", samples=8, tokens=40, now=1.0, version=1)
    ledger.credit("a", "peer-a2", "alice2", samples=4, tokens=20, now=2.0, version=1)  # same step: one history row
    ledger.credit("a", "peer-a2", "alice2", samples=4, tokens=20, now=3.0, version=2)
    ledger.reject("a", "peer-a2", "alice2", "stale", samples=3, now=4.0)
    ledger.reject("b", "peer-b", "bob", "bad_signature", now=5.0)
    ledger.credit_eval("b", "peer-b", "bob", samples=6, tokens=30, now=6.0)
    ledger.set_run(version=2, mode="async")
    ledger.close()

    ledger = Ledger(tmp_path / "ledger.sqlite")
    peers = {p["node_id"]: p for p in ledger.peers()}
    a, b = peers["a"], peers["b"]
    assert (a["accepted"], a["tokens"], a["rejected"], a["name"], a["peer_id"]) == (16, 80, 3, "alice2", "peer-a2")
    assert a["first_seen"] == 1.0 and a["last_seen"] == 4.0 and a["rejected_by_reason"] == {"stale": 3}
    assert (b["accepted"], b["eval_samples"], b["rejected_by_reason"]) == (0, 6, {"bad_signature": 1})
    assert [(h["version"], h["samples"], h["tokens"]) for h in ledger.history("a")] == [(1, 12, 60), (2, 4, 20)]
    assert ledger.rejection_totals() == {"stale": 3, "bad_signature": 1}
    assert ledger.run() == {"version": 2, "mode": "async"}
    ledger.close()


def test_a_keys_trust_record_is_stored_as_the_rule_changes_it(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    bans = BanRule(first=100.0)
    assert ledger.update_trust("n", lambda t: trust.verified(t, 8)).banned_until == 0
    first = ledger.update_trust("n", lambda t: trust.struck(t, bans, now=20.0))
    assert (first.verified, first.samples, first.failed, first.banned_until) == (1, 8, 1, 120.0)
    ledger.close()
    ledger = Ledger(tmp_path / "ledger.sqlite")  # it survives a restart
    assert ledger.trust("n") == first and ledger.trust("unknown") == Trust()
    ledger.close()


def test_a_known_keys_trust_is_read_without_the_ledger_thread_and_a_rolled_back_write_is_forgotten(tmp_path):
    """Every lease request reads its key's trust record: once known it is read from memory, so a
    lease does not queue behind a step's writes on the ledger's one thread."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    stored = ledger.update_trust("n", lambda t: trust.verified(t, 8))
    held, release = threading.Event(), threading.Event()
    busy = ledger.submit(lambda: (held.set(), release.wait(10)))
    assert held.wait(10)
    got: list[Trust] = []
    reader = threading.Thread(target=lambda: got.append(ledger.trust("n")))
    reader.start()
    reader.join(5)
    assert got == [stored]  # answered while the thread is busy
    release.set()
    busy.result()

    def struck_then_fail() -> None:
        with ledger.transaction():
            ledger.update_trust("n", lambda t: trust.struck(t, BanRule(first=100.0), now=1.0))
            raise RuntimeError("crash mid-transaction")

    with pytest.raises(RuntimeError):
        ledger.submit(struck_then_fail).result()
    assert ledger.trust("n") == stored  # not the strike that was rolled back
    ledger.close()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    assert ledger.trust("n") == stored
    ledger.close()

def test_a_transaction_that_fails_leaves_nothing_behind(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")

    def half_then_fail() -> None:
        with ledger.transaction() as db:
            db.execute("INSERT INTO run (key, value) VALUES ('x', '1')")
            raise RuntimeError("crash mid-transaction")

    try:
        ledger.submit(half_then_fail).result()
    except RuntimeError:
        pass
    assert ledger.run() == {}
    ledger.close()


def test_calls_from_many_threads_are_serialised_on_the_ledger_s_own_thread(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    threads = [threading.Thread(target=lambda i=i: [ledger.credit(f"n{i % 3}", "p", "x", 1, 2, version=1)
                                                    for _ in range(50)]) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(p["accepted"] for p in ledger.peers()) == 300
    ledger.close()


def test_metrics_rewind_drops_the_lines_of_steps_a_restart_will_redo(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for v in range(4):
        log.write({"version": v})
        log.write({"eval_version": v, "eval_accuracy": 0.5})
    log.close()
    MetricsLog.rewind(path, 2)  # state.json names version 2: steps 2 and 3 are trained again
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["version"] for r in kept if "version" in r] == [0, 1]
    assert [r["eval_version"] for r in kept if "eval_version" in r] == [0, 1, 2, 3]  # evaluations stand


def test_a_ledger_from_before_outlier_budgets_gains_their_columns(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    db.execute("CREATE TABLE trust (node_id TEXT PRIMARY KEY, verified INTEGER NOT NULL DEFAULT 0, "
               "failed INTEGER NOT NULL DEFAULT 0, banned_until REAL NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO trust VALUES ('k', 5, 1, 70.0)")
    db.commit()
    db.close()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    record = ledger.trust("k")
    assert (record.verified, record.failed, record.banned_until, record.samples, record.outliers) == (5, 1, 70.0, 0, 0)
    assert ledger.update_trust("k", lambda t: trust.outlier(t, OutlierBudget(first=0), BanRule(), 100.0)).failed == 2
    assert ledger.update_trust("k", lambda t: trust.verified(t, 16)).samples == 16
    ledger.close()


def test_keys_with_nothing_accepted_are_kept_to_a_bound_and_their_rejections_folded(tmp_path, monkeypatch):
    """Keys are free: signed junk from fresh keys may not grow the ledger without end. Past the
    bound the least recently seen unproven keys go, their rejections counted in one row; keys
    with accepted or evaluation samples stay whatever they did."""
    from echo_coordinator import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "UNPROVEN_KEYS", 5)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.credit("honest", "peer-h", "honest", samples=8, tokens=40, now=1.0, version=1)
    ledger.reject("honest", "peer-h", "honest", "stale", now=2.0)
    ledger.credit_eval("evaluator", "peer-e", "evaluator", samples=2, tokens=10, now=2.5)
    for i in range(20):
        ledger.reject(f"junk-{i}", f"peer-{i}", "junk", "bad_sampling", samples=2, now=3.0 + i)
        ledger.update_trust(f"junk-{i}", lambda t: trust.struck(t, BanRule(), now=3.0))
    peers = {p["node_id"]: p for p in ledger.peers()}
    assert set(peers) == {"honest", "evaluator"} | {f"junk-{i}" for i in range(15, 20)}
    assert ledger.rejection_totals() == {"stale": 1, "bad_sampling": 40}  # nothing lost from the totals
    assert ledger.trust("junk-0").failed == 0 and ledger.trust("junk-19").failed == 1
    assert peers["honest"]["rejected_by_reason"] == {"stale": 1}
    (rows,) = ledger.submit(lambda: ledger.db.execute("SELECT COUNT(*) FROM rejections").fetchone()).result()
    assert rows == 1 + 5 + 1  # honest's, the five kept, the folded row
    ledger.close()

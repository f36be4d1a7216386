"""The contribution ledger (SQLite) and the per-step metrics file.

`DIR/ledger.sqlite` holds the run's identity and current version (table `run`) and one row per
node key (table `peers`): what it got credited for and what was refused, by reason; and each key's
verification record and ban (table `trust`), so a ban outlives a restart; and what each key
was credited with at each step (table `history`), for its page on the dashboard; and its
held-out evaluation answers (table `evaluations`), credited apart because nothing trains on them. Only a key that signed
what it sent gets a row: a batch whose signature fails never touches the ledger. Every
write commits at once (WAL), so a crash loses nothing accepted and `echo-coordinator status`
can read while the trainer writes. `DIR/metrics.jsonl` gets one JSON object per trainer step
and one per finished evaluation round (those have `eval_version`).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    node_id TEXT PRIMARY KEY,      -- fingerprint of the node's signing key
    peer_id TEXT NOT NULL,         -- libp2p peer id it last spoke from
    name TEXT NOT NULL,            -- display name it announced
    accepted INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    tokens INTEGER NOT NULL DEFAULT 0,   -- tokens it generated (model turns) in trained samples
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rejections (
    node_id TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,
    PRIMARY KEY (node_id, reason)
);
CREATE TABLE IF NOT EXISTS trust (
    node_id TEXT PRIMARY KEY,
    verified INTEGER NOT NULL DEFAULT 0,   -- batches whose sampling was checked and passed
    failed INTEGER NOT NULL DEFAULT 0,     -- batches that failed verification: strikes
    banned_until REAL NOT NULL DEFAULT 0   -- unix seconds
);
CREATE TABLE IF NOT EXISTS history (
    node_id TEXT NOT NULL, version INTEGER NOT NULL,  -- the version the step trained into
    samples INTEGER NOT NULL, tokens INTEGER NOT NULL, time REAL NOT NULL,
    PRIMARY KEY (node_id, version)
);
CREATE TABLE IF NOT EXISTS evaluations (
    node_id TEXT PRIMARY KEY,
    samples INTEGER NOT NULL DEFAULT 0,  -- evaluation answers accepted
    tokens INTEGER NOT NULL DEFAULT 0
);
"""


@dataclass(frozen=True)
class Trust:
    verified: int = 0
    failed: int = 0
    banned_until: float = 0.0


class Ledger:
    """One connection shared by the handler threads and the step loop; `_lock` keeps their
    transactions from interleaving on it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
        self._lock = threading.RLock()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def trust(self, node_id: str) -> Trust:
        with self._lock:
            row = self.db.execute("SELECT verified, failed, banned_until FROM trust WHERE node_id = ?",
                                  (node_id,)).fetchone()
        return Trust(*row) if row else Trust()

    def record_check(self, node_id: str, passed: bool, ban_seconds, now: float) -> Trust:
        """Count one verified batch; a failure is a strike and bans the key for
        `ban_seconds(strikes)` from `now`. Returns the key's record after it."""
        with self._lock, self.db:
            old = self.trust(node_id)
            new = Trust(old.verified + passed, old.failed + (not passed),
                        old.banned_until if passed else max(old.banned_until, now + ban_seconds(old.failed + 1)))
            self.db.execute(
                "INSERT INTO trust (node_id, verified, failed, banned_until) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET verified = excluded.verified, failed = excluded.failed, "
                "banned_until = excluded.banned_until",
                (node_id, new.verified, new.failed, new.banned_until),
            )
        return new

    def close(self) -> None:
        self.db.close()

    def set_run(self, **values: Any) -> None:
        with self._lock, self.db:
            self.db.executemany(
                "INSERT INTO run (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def run(self) -> dict[str, Any]:
        with self._lock:
            return {k: json.loads(v) for k, v in self.db.execute("SELECT key, value FROM run")}

    def _touch(self, node_id: str, peer_id: str, name: str, now: float) -> None:
        self.db.execute(
            "INSERT INTO peers (node_id, peer_id, name, first_seen, last_seen) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id) DO UPDATE SET peer_id = excluded.peer_id, name = excluded.name, "
            "last_seen = excluded.last_seen",
            (node_id, peer_id, name, now, now),
        )

    def credit(self, node_id: str, peer_id: str, name: str, samples: int, tokens: int, now: float | None = None,
               version: int = 0) -> None:
        """Credit trained samples; `version` is the one the step that trained them publishes."""
        now = now or time.time()
        with self._lock, self.db:
            self._touch(node_id, peer_id, name, now)
            self.db.execute(
                "UPDATE peers SET accepted = accepted + ?, tokens = tokens + ? WHERE node_id = ?",
                (samples, tokens, node_id),
            )
            self.db.execute(
                "INSERT INTO history (node_id, version, samples, tokens, time) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(node_id, version) DO UPDATE SET samples = samples + excluded.samples, "
                "tokens = tokens + excluded.tokens, time = excluded.time",
                (node_id, version, samples, tokens, now),
            )

    def credit_eval(self, node_id: str, peer_id: str, name: str, samples: int, tokens: int,
                    now: float | None = None) -> None:
        """Credit accepted evaluation answers (held-out accuracy): apart from trained samples."""
        with self._lock, self.db:
            self._touch(node_id, peer_id, name, now or time.time())
            self.db.execute(
                "INSERT INTO evaluations (node_id, samples, tokens) VALUES (?, ?, ?) ON CONFLICT(node_id) DO UPDATE "
                "SET samples = samples + excluded.samples, tokens = tokens + excluded.tokens",
                (node_id, samples, tokens),
            )

    def history(self, node_id: str) -> list[dict[str, Any]]:
        """What `node_id` was credited with, step by step."""
        with self._lock:
            rows = self.db.execute("SELECT version, samples, tokens, time FROM history WHERE node_id = ? ORDER BY version",
                                   (node_id,)).fetchall()
        return [dict(zip(("version", "samples", "tokens", "time"), row)) for row in rows]

    def reject(self, node_id: str, peer_id: str, name: str, reason: str, samples: int = 1, now: float | None = None) -> None:
        with self._lock, self.db:
            self._touch(node_id, peer_id, name, now or time.time())
            self.db.execute("UPDATE peers SET rejected = rejected + ? WHERE node_id = ?", (samples, node_id))
            self.db.execute(
                "INSERT INTO rejections (node_id, reason, count) VALUES (?, ?, ?) "
                "ON CONFLICT(node_id, reason) DO UPDATE SET count = count + excluded.count",
                (node_id, reason, samples),
            )

    def rejection_totals(self) -> dict[str, int]:
        """Samples refused, by reason, over every key."""
        with self._lock:
            return dict(self.db.execute("SELECT reason, SUM(count) FROM rejections GROUP BY reason").fetchall())

    def peers(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self.db.execute(
                "SELECT p.node_id, p.peer_id, p.name, p.accepted, p.rejected, p.tokens, p.first_seen, p.last_seen, "
                "COALESCE(t.verified, 0), COALESCE(t.failed, 0), COALESCE(t.banned_until, 0), COALESCE(e.samples, 0) "
                "FROM peers p LEFT JOIN trust t ON t.node_id = p.node_id LEFT JOIN evaluations e ON e.node_id = p.node_id "
                "ORDER BY p.accepted DESC"
            ).fetchall()
            reasons: dict[str, dict[str, int]] = {}
            for node_id, reason, count in self.db.execute("SELECT node_id, reason, count FROM rejections"):
                reasons.setdefault(node_id, {})[reason] = count
        keys = ("node_id", "peer_id", "name", "accepted", "rejected", "tokens", "first_seen", "last_seen", "verified_batches",
                "failed_batches", "banned_until", "eval_samples")
        return [{**dict(zip(keys, row)), "rejected_by_reason": reasons.get(row[0], {})} for row in rows]


class MetricsLog:
    """Appends one JSON line per record (a step, or an evaluation: `eval_version`) and flushes it,
    so a crash keeps every finished one."""

    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()

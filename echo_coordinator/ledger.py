"""The contribution ledger (SQLite) and the per-step metrics file.

`DIR/ledger.sqlite` holds the run's identity and current version (table `run`) and one row per
node key (table `peers`): what it got credited for and what was refused, by reason; and each key's
verification record and ban (table `trust`), so a ban outlives a restart; and what each key
was credited with at each step (table `history`), for its page on the dashboard; and its
held-out evaluation answers (table `evaluations`), credited apart because nothing trains on them. Only a key that signed
what it sent gets a row: a batch whose signature fails never touches the ledger. The same file
holds the coordinator's journal (`journal.py`: accepted groups not yet trained on, the lease
book), so a step's credits and its groups leave the buffer in one transaction. Every write
commits before its caller goes on (WAL), so a crash, SIGKILL included, loses nothing accepted,
and `echo-coordinator status` can read while the trainer writes. `DIR/metrics.jsonl` gets one JSON object per trainer step
and one per finished evaluation round (those have `eval_version`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from echo_coordinator.trust import Trust

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
    banned_until REAL NOT NULL DEFAULT 0,  -- unix seconds
    samples INTEGER NOT NULL DEFAULT 0,    -- samples in the verified batches
    outliers INTEGER NOT NULL DEFAULT 0    -- batches refused for a lone outlier (protocols.sampling.judge)
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


# Keys with nothing accepted keep their own rows up to this many: keys are free, so signed junk
# from fresh keys would otherwise grow the ledger, and every dashboard read of it, without end.
# Past it the least recently seen are folded into one row of rejection counts (node_id '').
UNPROVEN_KEYS = 1000
UNPROVEN = "accepted = 0 AND node_id NOT IN (SELECT node_id FROM evaluations)"

# Trust records kept in memory (`Ledger.trust`): every lease request reads its key's twice and every
# push once, and a trip to the ledger's one thread queues behind each step's writes (measured at
# 600 volunteers: two thirds of that thread's time went to these reads). Keys without a record are
# remembered too (a crowd of new keys reads theirs as often). Past this many (keys are free), the
# memory starts again from the file.
TRUST_CACHE = 100_000

# Columns added since the table was first shipped: a ledger from an older version gains them.
TRUST_ADDED = {"samples": "INTEGER NOT NULL DEFAULT 0", "outliers": "INTEGER NOT NULL DEFAULT 0"}


def _owned(method):
    """Run `method` on the ledger's own thread and wait for it (inline when already there)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if threading.current_thread() is self._owner:
            return method(self, *args, **kwargs)
        return self.submit(method, self, *args, **kwargs).result()

    return run


class Ledger:
    """The ledger's one writer: a thread that owns the connection and runs every read and write.
    Handler threads, the step loop and the dashboard hand it work and wait for the answer, so
    transactions never interleave and nothing is shared across threads but the queue."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ledger")
        self._depth = 0  # open `transaction()` blocks (on the ledger thread)
        # node id -> its stored trust record: written only on the ledger thread, as the file is,
        # read from any (a read that races a write sees the record before or after it, as a read
        # queued on the thread would).
        self._trust: dict[str, Trust] = {}
        self._closed = False
        self._thread.submit(self._connect).result()

    def _connect(self) -> None:
        self._owner = threading.current_thread()
        # isolation_level=None: autocommit, and `transaction()` says where a transaction begins.
        # synchronous=NORMAL in WAL mode: a commit survives the process dying (SIGKILL); only an
        # OS crash or power cut can lose the last few.
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        have = {row[1] for row in self.db.execute("PRAGMA table_info(trust)")}
        for column, kind in TRUST_ADDED.items():
            if column not in have:
                self.db.execute(f"ALTER TABLE trust ADD COLUMN {column} {kind}")

    @_owned
    def add_tables(self, schema: str) -> None:
        """More tables in this file (the journal's), written by this same thread."""
        self.db.executescript(schema)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Queue `fn` on the ledger thread; calls run in the order they were submitted."""
        return self._thread.submit(fn, *args, **kwargs)

    @contextlib.contextmanager
    def transaction(self):
        """All or nothing (on the ledger thread); nested blocks join the outer one."""
        if self._depth == 0:
            self.db.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield self.db
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self.db.execute("ROLLBACK")
                self._trust = {}  # it may hold what was rolled back
            raise
        self._depth -= 1
        if self._depth == 0:
            try:
                self.db.execute("COMMIT")
            except sqlite3.Error:
                self._trust = {}
                raise

    def trust(self, node_id: str) -> Trust:
        """The key's trust record: from memory once read, else from the file on the ledger thread."""
        cached = self._trust.get(node_id)
        return cached if cached is not None else self._read_trust(node_id)

    @_owned
    def _read_trust(self, node_id: str) -> Trust:
        row = self.db.execute("SELECT verified, failed, banned_until, samples, outliers FROM trust WHERE node_id = ?",
                              (node_id,)).fetchone()
        return self._remember(node_id, Trust(*row) if row else Trust())

    def _remember(self, node_id: str, trust: Trust) -> Trust:
        if len(self._trust) >= TRUST_CACHE:
            self._trust = {}
        self._trust[node_id] = trust
        return trust

    @_owned
    def update_trust(self, node_id: str, change: Callable[[Trust], Trust]) -> Trust:
        """Store `change(record)` as the key's trust record, read and written in one transaction
        (the rule itself is `echo_coordinator.trust`); returns the new record."""
        with self.transaction():
            return self._save(node_id, change(self.trust(node_id)))

    def _save(self, node_id: str, trust: Trust) -> Trust:
        self.db.execute(
            "INSERT INTO trust (node_id, verified, failed, banned_until, samples, outliers) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id) DO UPDATE SET verified = excluded.verified, failed = excluded.failed, "
            "banned_until = excluded.banned_until, samples = excluded.samples, outliers = excluded.outliers",
            (node_id, trust.verified, trust.failed, trust.banned_until, trust.samples, trust.outliers),
        )
        return self._remember(node_id, trust)

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close; waits for queued work first."""
        if self._closed:
            return
        self._closed = True

        def close() -> None:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.db.close()

        self.submit(close).result()
        self._thread.shutdown()

    @_owned
    def set_run(self, **values: Any) -> None:
        with self.transaction():
            self.db.executemany(
                "INSERT INTO run (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    @_owned
    def run(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.db.execute("SELECT key, value FROM run")}

    def _touch(self, node_id: str, peer_id: str, name: str, now: float) -> None:
        self.db.execute(
            "INSERT INTO peers (node_id, peer_id, name, first_seen, last_seen) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id) DO UPDATE SET peer_id = excluded.peer_id, name = excluded.name, "
            "last_seen = excluded.last_seen",
            (node_id, peer_id, name, now, now),
        )

    @_owned
    def credit(self, node_id: str, peer_id: str, name: str, samples: int, tokens: int, now: float | None = None,
               version: int = 0) -> None:
        """Credit trained samples; `version` is the one the step that trained them publishes."""
        now = now or time.time()
        with self.transaction():
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

    @_owned
    def credit_eval(self, node_id: str, peer_id: str, name: str, samples: int, tokens: int,
                    now: float | None = None) -> None:
        """Credit accepted evaluation answers (held-out accuracy): apart from trained samples."""
        with self.transaction():
            self._touch(node_id, peer_id, name, now or time.time())
            self.db.execute(
                "INSERT INTO evaluations (node_id, samples, tokens) VALUES (?, ?, ?) ON CONFLICT(node_id) DO UPDATE "
                "SET samples = samples + excluded.samples, tokens = tokens + excluded.tokens",
                (node_id, samples, tokens),
            )

    @_owned
    def history(self, node_id: str) -> list[dict[str, Any]]:
        """What `node_id` was credited with, step by step."""
        rows = self.db.execute("SELECT version, samples, tokens, time FROM history WHERE node_id = ? ORDER BY version",
                               (node_id,)).fetchall()
        return [dict(zip(("version", "samples", "tokens", "time"), row)) for row in rows]

    @_owned
    def reject(self, node_id: str, peer_id: str, name: str, reason: str, samples: int = 1, now: float | None = None) -> None:
        with self.transaction():
            self._touch(node_id, peer_id, name, now or time.time())
            self.db.execute("UPDATE peers SET rejected = rejected + ? WHERE node_id = ?", (samples, node_id))
            self.db.execute(
                "INSERT INTO rejections (node_id, reason, count) VALUES (?, ?, ?) "
                "ON CONFLICT(node_id, reason) DO UPDATE SET count = count + excluded.count",
                (node_id, reason, samples),
            )
            self._fold_unproven()

    def _fold_unproven(self) -> None:
        """Keep UNPROVEN_KEYS keys with nothing accepted; fold older ones' rejections into node_id ''
        (totals stay whole) and forget them. A folded key that comes back starts as a new key
        does, which any key may do with a fresh key anyway."""
        (count,) = self.db.execute(f"SELECT COUNT(*) FROM peers WHERE {UNPROVEN}").fetchone()
        if count <= UNPROVEN_KEYS:
            return
        folded = [row[0] for row in self.db.execute(
            f"SELECT node_id FROM peers WHERE {UNPROVEN} ORDER BY last_seen LIMIT ?", (count - UNPROVEN_KEYS,))]
        marks = ", ".join("?" * len(folded))
        self.db.execute(
            f"INSERT INTO rejections (node_id, reason, count) SELECT '', reason, SUM(count) FROM rejections "
            f"WHERE node_id IN ({marks}) GROUP BY reason ON CONFLICT(node_id, reason) DO UPDATE SET count = count + excluded.count",
            folded)
        for table in ("rejections", "trust", "peers"):
            self.db.execute(f"DELETE FROM {table} WHERE node_id IN ({marks})", folded)
        for node_id in folded:
            self._trust.pop(node_id, None)

    @_owned
    def rejection_totals(self) -> dict[str, int]:
        """Samples refused, by reason, over every key."""
        return dict(self.db.execute("SELECT reason, SUM(count) FROM rejections GROUP BY reason").fetchall())

    @_owned
    def peers(self) -> list[dict[str, Any]]:
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

    @staticmethod
    def rewind(path: Path, version: int) -> None:
        """After a restart at `version`: drop the lines of steps from `version` on (a crash after
        a step's metrics line but before its `state.json` loses that step; it is trained again)."""
        if not path.exists():
            return
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and ("eval_version" in (r := json.loads(line)) or r["version"] < version)]
        if len(kept) != len(lines):
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            tmp.replace(path)

"""The contribution ledger (SQLite) and the per-step metrics file.

`DIR/ledger.sqlite` holds the run's identity and current version (table `run`) and one row per
node key (table `peers`): what it got credited for and what was refused, by reason. Every
write commits at once (WAL), so a crash loses nothing accepted and `echo-coordinator status`
can read while the trainer writes. `DIR/metrics.jsonl` gets one JSON object per trainer step.
"""

from __future__ import annotations

import json
import sqlite3
import time
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
"""


class Ledger:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def set_run(self, **values: Any) -> None:
        with self.db:
            self.db.executemany(
                "INSERT INTO run (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def run(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.db.execute("SELECT key, value FROM run")}

    def _touch(self, node_id: str, peer_id: str, name: str, now: float) -> None:
        self.db.execute(
            "INSERT INTO peers (node_id, peer_id, name, first_seen, last_seen) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id) DO UPDATE SET peer_id = excluded.peer_id, name = excluded.name, "
            "last_seen = excluded.last_seen",
            (node_id, peer_id, name, now, now),
        )

    def credit(self, node_id: str, peer_id: str, name: str, samples: int, tokens: int, now: float | None = None) -> None:
        with self.db:
            self._touch(node_id, peer_id, name, now or time.time())
            self.db.execute(
                "UPDATE peers SET accepted = accepted + ?, tokens = tokens + ? WHERE node_id = ?",
                (samples, tokens, node_id),
            )

    def reject(self, node_id: str, peer_id: str, name: str, reason: str, samples: int = 1, now: float | None = None) -> None:
        with self.db:
            self._touch(node_id, peer_id, name, now or time.time())
            self.db.execute("UPDATE peers SET rejected = rejected + ? WHERE node_id = ?", (samples, node_id))
            self.db.execute(
                "INSERT INTO rejections (node_id, reason, count) VALUES (?, ?, ?) "
                "ON CONFLICT(node_id, reason) DO UPDATE SET count = count + excluded.count",
                (node_id, reason, samples),
            )

    def peers(self) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT node_id, peer_id, name, accepted, rejected, tokens, last_seen FROM peers ORDER BY accepted DESC"
        ).fetchall()
        reasons: dict[str, dict[str, int]] = {}
        for node_id, reason, count in self.db.execute("SELECT node_id, reason, count FROM rejections"):
            reasons.setdefault(node_id, {})[reason] = count
        keys = ("node_id", "peer_id", "name", "accepted", "rejected", "tokens", "last_seen")
        return [{**dict(zip(keys, row)), "rejected_by_reason": reasons.get(row[0], {})} for row in rows]


class MetricsLog:
    """Appends one JSON line per step and flushes it, so a crash keeps every finished step."""

    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()

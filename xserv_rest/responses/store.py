"""Stored responses: one SQLite database (WAL) shared by every gunicorn worker, kept across
restarts, bounded by age and total size (the oldest go first).

A row holds a response as sent and its context: the input items that led to it (a previous
response's context and output, then this request's input), so that previous_response_id needs
one read. Each process opens its own connection after fork; threads share it under a lock.
SQLite's busy timeout serializes the workers' writes.
"""

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""
BUSY_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class Stored:
    response: dict
    context: list[dict]


class ResponseStore:
    def __init__(self, path: str | None, max_age_s: float, max_bytes: int):
        """`path` None: a database in this process's memory, for tests and a bare WSGI app."""
        self.path = path
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._db: sqlite3.Connection | None = None
        self._inherited: list[sqlite3.Connection | None] = []

    def put(self, response: dict, context: list[dict]) -> None:
        response_json, context_json = json.dumps(response, ensure_ascii=False), json.dumps(context, ensure_ascii=False)
        with self._lock:
            db = self._connection()
            with db:
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                           (response["id"], time.time(), response_json, context_json,
                            len(response_json) + len(context_json)))
                self._prune(db)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            row = self._connection().execute(
                "SELECT response, context FROM responses WHERE id = ? AND created_at >= ?",
                (response_id, time.time() - self.max_age_s)).fetchone()
        return Stored(json.loads(row[0]), json.loads(row[1])) if row else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            db = self._connection()
            with db:
                return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def _prune(self, db: sqlite3.Connection) -> None:
        """Drops rows past the age limit, then the oldest until the rest fit in max_bytes."""
        db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
        cutoff = db.execute(
            "SELECT created_at FROM (SELECT created_at, SUM(size) OVER (ORDER BY created_at DESC, id) AS kept "
            "FROM responses) WHERE kept > ? ORDER BY created_at DESC LIMIT 1", (self.max_bytes,)).fetchone()
        if cutoff:
            db.execute("DELETE FROM responses WHERE created_at <= ?", cutoff)

    def _connection(self) -> sqlite3.Connection:
        """This process's connection (a connection must not cross fork); call under the lock."""
        if self._pid != os.getpid():
            # SQLite connections must not be used across fork: the child leaves an inherited one
            # alone (not even closing it, which would touch the parent's locks and WAL).
            self._inherited.append(self._db)
            self._db = self._open()
            self._pid = os.getpid()
        return self._db

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            db = sqlite3.connect(":memory:", check_same_thread=False)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return db

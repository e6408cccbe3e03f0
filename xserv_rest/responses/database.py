"""The store of the Responses and Conversations APIs: one SQLite database (WAL) shared by every
gunicorn worker, kept across restarts, bounded by age and total size (the oldest go first).

Each process opens its own connection after fork; threads share it under a lock. SQLite's busy
timeout serializes the workers' writes. Stored responses, their recorded stream events and
conversations count toward the same limits: a response or a conversation ages from its last
write, and past max_bytes the least recently written go first.
"""

import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from typing import Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
CREATE TABLE IF NOT EXISTS response_runs (
    id TEXT PRIMARY KEY REFERENCES responses (id) ON DELETE CASCADE,
    owner TEXT NOT NULL,
    background INTEGER NOT NULL,
    cancel INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT NOT NULL REFERENCES responses (id) ON DELETE CASCADE,
    sequence_number INTEGER NOT NULL,
    event TEXT NOT NULL,
    PRIMARY KEY (response_id, sequence_number)
);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    conversation TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS conversations_created_at ON conversations (created_at);
CREATE TABLE IF NOT EXISTS conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    item_id TEXT NOT NULL,
    item TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS conversation_items_id ON conversation_items (conversation_id, item_id);
"""
BUSY_TIMEOUT_MS = 10_000
# Both kinds of rows, newest first, with the bytes kept by the rows at least as new.
KEPT = ("SELECT created_at, SUM(size) OVER (ORDER BY created_at DESC) AS kept FROM "
        "(SELECT created_at, size FROM responses UNION ALL SELECT created_at, size FROM conversations)")


class Database:
    def __init__(self, path: str | None, max_age_s: float, max_bytes: int):
        """`path` None: a database in this process's memory, for tests and a bare WSGI app."""
        self.path = path
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._db: sqlite3.Connection | None = None
        self._inherited: list[sqlite3.Connection | None] = []

    def oldest_kept(self) -> float:
        """created_at of the oldest row still within the age limit."""
        return time.time() - self.max_age_s

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._connection()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One transaction, taken with the write lock up front (BEGIN IMMEDIATE), so that what it
        reads stays true until it commits."""
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.rollback()
                raise
            db.commit()

    def prune(self, db: sqlite3.Connection) -> None:
        """Drops rows past the age limit, then the oldest until the rest fit in max_bytes; call
        inside write()."""
        cutoff = self.oldest_kept()
        row = db.execute(f"SELECT created_at FROM ({KEPT}) WHERE kept > ? ORDER BY created_at DESC LIMIT 1",
                         (self.max_bytes,)).fetchone()
        if row:
            cutoff = max(cutoff, row[0] + 1e-6)
        db.execute("DELETE FROM responses WHERE created_at < ?", (cutoff,))
        db.execute("DELETE FROM conversations WHERE created_at < ?", (cutoff,))

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
            db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False,
                                 isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.executescript(SCHEMA)
        return db

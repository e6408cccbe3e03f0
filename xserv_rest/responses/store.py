"""Stored responses, in the shared database (database.py).

A row holds a response as sent and its context: the input items that led to it (a previous
response's context and output, or a conversation's items, then this request's input), so that
previous_response_id and input_items need one read. A response still being generated has a run
row too: the worker process that owns it (to tell a run whose worker died), whether it runs in
the background, and whether a cancel was asked for; its stream events are recorded as they are
made, numbered by sequence_number, so that any worker can replay and follow them.
"""

import json
import os
import sqlite3
import time
from dataclasses import dataclass

from xserv_rest.responses.database import Database

UNFINISHED = ("queued", "in_progress")
ABANDONED = "the server stopped before this response finished (its worker process is gone)"


@dataclass(frozen=True)
class Stored:
    response: dict
    context: list[dict]


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class ResponseStore:
    def __init__(self, database: Database):
        self.database = database

    def put(self, response: dict, context: list[dict]) -> None:
        """Stores a finished response (or updates one whose run ends); its run row goes."""
        response_json, context_json = _json(response), _json(context)
        with self.database.write() as db:
            self._upsert(db, response["id"], response_json, context_json)
            db.execute("DELETE FROM response_runs WHERE id = ?", (response["id"],))
            self.database.prune(db)

    def start(self, response: dict, context: list[dict], background: bool, max_background: int | None = None) -> bool:
        """Stores a response that starts running in this process; False (nothing stored) when
        `max_background` background runs are unfinished already."""
        with self.database.write() as db:
            if max_background is not None:
                self._fail_abandoned(db)
                running = db.execute("SELECT COUNT(*) FROM response_runs WHERE background = 1").fetchone()[0]
                if running >= max_background:
                    return False
            self._upsert(db, response["id"], _json(response), _json(context))
            db.execute("INSERT INTO response_runs (id, owner, background) VALUES (?, ?, ?)",
                       (response["id"], process_owner(), int(background)))
            self.database.prune(db)
        return True

    def record(self, response: dict, events: list[dict]) -> bool:
        """Appends a running response's events and its snapshot; False when it is no longer
        running (cancelled, or deleted)."""
        response_id = response["id"]
        with self.database.write() as db:
            if db.execute("SELECT 1 FROM response_runs WHERE id = ?", (response_id,)).fetchone() is None:
                return False
            rows = [(response_id, event["sequence_number"], _json(event)) for event in events]
            db.executemany("INSERT INTO response_events VALUES (?, ?, ?)", rows)
            response_json = _json(response)
            # the right-hand side reads the old row: its response's length goes, the new one's comes
            db.execute("UPDATE responses SET size = size - length(response) + ? + ?, response = ? WHERE id = ?",
                       (len(response_json), sum(len(row[2]) for row in rows), response_json, response_id))
        return True

    def finish(self, response: dict, made: list[dict], final: list[dict], context: list[dict]) -> dict | None:
        """A run's events not yet recorded (`made`), its final events and its final response;
        when a cancel ended it, its output so far (every made event) is kept under the cancelled
        status and the final events are not. The response as stored, or None when it was deleted
        while it ran."""
        response_id = response["id"]
        with self.database.write() as db:
            run = db.execute("SELECT cancel FROM response_runs WHERE id = ?", (response_id,)).fetchone()
            if run is None:
                return None
            events = made + final
            if run[0]:
                response = dict(response, status="cancelled", error=None, incomplete_details=None)
                events = made
            db.executemany("INSERT INTO response_events VALUES (?, ?, ?)",
                           [(response_id, event["sequence_number"], _json(event)) for event in events])
            self._upsert(db, response_id, _json(response), _json(context))
            db.execute("DELETE FROM response_runs WHERE id = ?", (response_id,))
            self.database.prune(db)
        return response

    def discard(self, response_id: str) -> None:
        """A foreground run whose client went away: nothing of it is kept."""
        with self.database.write() as db:
            db.execute("DELETE FROM responses WHERE id = ?", (response_id,))

    def get(self, response_id: str) -> Stored | None:
        with self.database.read() as db:
            row = db.execute("SELECT response, context FROM responses WHERE id = ? AND created_at >= ?",
                             (response_id, self.database.oldest_kept())).fetchone()
        if row is None:
            return None
        stored = Stored(json.loads(row[0]), json.loads(row[1]))
        if stored.response.get("status") in UNFINISHED and not self._owner_alive(response_id):
            with self.database.write() as db:
                self._fail_abandoned(db)
            return self.get(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        with self.database.write() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def cancel(self, response_id: str) -> dict | None:
        """Marks a running background response cancelled (its worker stops the engine call on
        seeing it); the response as it stands, or None when it is not a running background one."""
        with self.database.write() as db:
            run = db.execute("SELECT background FROM response_runs WHERE id = ?", (response_id,)).fetchone()
            if run is None or not run[0]:
                return None
            db.execute("UPDATE response_runs SET cancel = 1 WHERE id = ?", (response_id,))
            response = json.loads(db.execute("SELECT response FROM responses WHERE id = ?",
                                             (response_id,)).fetchone()[0])
            response["status"] = "cancelled"
            db.execute("UPDATE responses SET response = ? WHERE id = ?", (_json(response), response_id))
        return response

    def cancelled(self, owner: str) -> list[str]:
        """The ids of this owner's runs that were asked to stop."""
        with self.database.read() as db:
            return [row[0] for row in db.execute("SELECT id FROM response_runs WHERE owner = ? AND cancel = 1",
                                                 (owner,))]

    def has_events(self, response_id: str) -> bool:
        with self.database.read() as db:
            return db.execute("SELECT 1 FROM response_events WHERE response_id = ? LIMIT 1",
                              (response_id,)).fetchone() is not None

    def events_after(self, response_id: str, after: int) -> tuple[list[dict], bool]:
        """The recorded events numbered past `after`, and whether the response has finished
        (read first: a finished run wrote its last events in the same transaction)."""
        with self.database.read() as db:
            db.execute("BEGIN")
            try:
                running = db.execute("SELECT 1 FROM response_runs WHERE id = ?", (response_id,)).fetchone()
                rows = db.execute("SELECT event FROM response_events WHERE response_id = ? AND sequence_number > ? "
                                  "ORDER BY sequence_number", (response_id, after)).fetchall()
            finally:
                db.execute("COMMIT")
        return [json.loads(row[0]) for row in rows], running is None

    def _owner_alive(self, response_id: str) -> bool:
        with self.database.read() as db:
            row = db.execute("SELECT owner FROM response_runs WHERE id = ?", (response_id,)).fetchone()
        return row is None or owner_alive(row[0])

    def _fail_abandoned(self, db: sqlite3.Connection) -> None:
        """Runs whose worker process is gone (a front restart, a crashed worker) end as failed."""
        for response_id, owner in db.execute("SELECT id, owner FROM response_runs").fetchall():
            if owner_alive(owner):
                continue
            row = db.execute("SELECT response FROM responses WHERE id = ?", (response_id,)).fetchone()
            response = json.loads(row[0])
            response.update(status="failed", error={"code": "server_error", "message": ABANDONED})
            db.execute("UPDATE responses SET response = ? WHERE id = ?", (_json(response), response_id))
            db.execute("DELETE FROM response_runs WHERE id = ?", (response_id,))

    def _upsert(self, db: sqlite3.Connection, response_id: str, response_json: str, context_json: str) -> None:
        events = db.execute("SELECT COALESCE(SUM(length(event)), 0) FROM response_events WHERE response_id = ?",
                            (response_id,)).fetchone()[0]
        db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO "
                   "UPDATE SET created_at = excluded.created_at, response = excluded.response, "
                   "context = excluded.context, size = excluded.size",
                   (response_id, time.time(), response_json, context_json,
                    len(response_json) + len(context_json) + events))


def process_owner(pid: int | None = None) -> str:
    """This process, named so that a later process with the same pid is told apart: pid and
    start time (in clock ticks since boot, from /proc)."""
    pid = pid or os.getpid()
    return f"{pid}:{_start_time(pid)}"


def owner_alive(owner: str) -> bool:
    pid = int(owner.split(":")[0])
    return _start_time(pid) is not None and process_owner(pid) == owner


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except OSError:
        return "?"  # no /proc: the pid alone

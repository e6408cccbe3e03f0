"""Conversations and their items, in the shared database (responses/database.py), under the same
age and size limits as responses: a conversation ages from its last write."""

import json
import time

from xserv_rest.responses.database import Database


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class ConversationStore:
    def __init__(self, database: Database):
        self.database = database

    def create(self, conversation: dict, items: list[dict]) -> None:
        with self.database.write() as db:
            conversation_json = _json(conversation)
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?)",
                       (conversation["id"], time.time(), conversation_json, len(conversation_json)))
            self._add(db, conversation["id"], items)
            self.database.prune(db)

    def get(self, conversation_id: str) -> dict | None:
        with self.database.read() as db:
            row = db.execute("SELECT conversation FROM conversations WHERE id = ? AND created_at >= ?",
                             (conversation_id, self.database.oldest_kept())).fetchone()
        return json.loads(row[0]) if row else None

    def update(self, conversation_id: str, metadata: dict) -> dict | None:
        conversation = self.get(conversation_id)
        if conversation is None:
            return None
        conversation["metadata"] = metadata
        conversation_json = _json(conversation)
        with self.database.write() as db:
            db.execute("UPDATE conversations SET created_at = ?, size = size - length(conversation) + ?, "
                       "conversation = ? WHERE id = ?",
                       (time.time(), len(conversation_json), conversation_json, conversation_id))
        return conversation

    def delete(self, conversation_id: str) -> bool:
        with self.database.write() as db:
            return db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount > 0

    def items(self, conversation_id: str) -> list[dict] | None:
        """Its items, oldest first; None when there is no such conversation."""
        if self.get(conversation_id) is None:
            return None
        with self.database.read() as db:
            rows = db.execute("SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY seq",
                              (conversation_id,)).fetchall()
        return [json.loads(row[0]) for row in rows]

    def add_items(self, conversation_id: str, items: list[dict]) -> bool:
        """Appends items (each with an id); False when there is no such conversation."""
        with self.database.write() as db:
            if db.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone() is None:
                return False
            self._add(db, conversation_id, items)
            self.database.prune(db)
        return True

    def item(self, conversation_id: str, item_id: str) -> dict | None:
        with self.database.read() as db:
            row = db.execute("SELECT item FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                             (conversation_id, item_id)).fetchone()
        return json.loads(row[0]) if row else None

    def delete_item(self, conversation_id: str, item_id: str) -> bool:
        with self.database.write() as db:
            row = db.execute("SELECT length(item) FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                             (conversation_id, item_id)).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                       (conversation_id, item_id))
            db.execute("UPDATE conversations SET size = size - ? WHERE id = ?", (row[0], conversation_id))
        return True

    def _add(self, db, conversation_id: str, items: list[dict]) -> None:
        rows = [(conversation_id, item["id"], _json(item)) for item in items]
        db.executemany("INSERT OR IGNORE INTO conversation_items (conversation_id, item_id, item) VALUES (?, ?, ?)",
                       rows)
        db.execute("UPDATE conversations SET created_at = ?, size = size + ? WHERE id = ?",
                   (time.time(), sum(len(row[2]) for row in rows), conversation_id))

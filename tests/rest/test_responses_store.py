"""The Responses store: shared by processes (as gunicorn's workers), kept on disk, bounded by age
and total size, the oldest going first."""

import json
import multiprocessing
import time

from xserv_rest.responses.database import Database
from xserv_rest.responses.store import ResponseStore

DAY = 86400.0


def response(response_id: str, text: str = "x") -> dict:
    return {"id": response_id, "object": "response", "output": [{"type": "message", "content": text}]}


def test_put_get_delete_and_reopen(tmp_path):
    path = str(tmp_path / "deep" / "store.sqlite3")
    store = ResponseStore(Database(path, max_age_s=DAY, max_bytes=10**6))
    store.put(response("resp_1", "héllo 🙂"), [{"role": "user", "content": "hi"}])
    reopened = ResponseStore(Database(path, max_age_s=DAY, max_bytes=10**6))
    stored = reopened.get("resp_1")
    assert stored.response == response("resp_1", "héllo 🙂")
    assert stored.context == [{"role": "user", "content": "hi"}]
    assert reopened.delete("resp_1") and not reopened.delete("resp_1")
    assert store.get("resp_1") is None and store.get("resp_unknown") is None


def test_rows_past_the_age_limit_are_gone(tmp_path, monkeypatch):
    store = ResponseStore(Database(str(tmp_path / "s.sqlite3"), max_age_s=60, max_bytes=10**6))
    store.put(response("resp_old"), [])
    later = time.time() + 61
    monkeypatch.setattr(time, "time", lambda: later)
    assert store.get("resp_old") is None  # expired, though not yet pruned
    store.put(response("resp_new"), [])  # the write prunes
    monkeypatch.undo()
    assert ResponseStore(Database(str(tmp_path / "s.sqlite3"), max_age_s=10 * DAY, max_bytes=10**6)).get("resp_old") is None


def test_past_the_size_limit_the_oldest_go(tmp_path):
    one = len(json.dumps(response("resp_0", "a" * 1000), ensure_ascii=False)) + len("[]")
    store = ResponseStore(Database(str(tmp_path / "s.sqlite3"), max_age_s=DAY, max_bytes=3 * one))
    for index in range(5):
        store.put(response(f"resp_{index}", "a" * 1000), [])
    assert [store.get(f"resp_{index}") is not None for index in range(5)] == [False, False, True, True, True]


def _write(store: ResponseStore, prefix: str, count: int) -> None:
    for index in range(count):
        store.put(response(f"{prefix}_{index}"), [{"role": "user", "content": str(index)}])


def test_forked_processes_write_at_once_and_read_each_other(tmp_path):
    """As gunicorn's workers: forked after the parent used the store, each opens its own connection."""
    store = ResponseStore(Database(str(tmp_path / "shared.sqlite3"), max_age_s=DAY, max_bytes=10**8))
    _write(store, "resp_parent", 1)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write, args=(store, f"resp_p{n}", 40)) for n in range(3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    assert store.get("resp_parent_0") and all(store.get(f"resp_p{n}_{index}") for n in range(3) for index in range(40))


def test_a_cancelled_run_keeps_the_events_of_its_output_so_far_and_no_final_ones(tmp_path):
    """A follower reads the recorded events while the stored response holds the output: a cancel
    must leave the two telling the same text, the events made since the last flush included."""
    store = ResponseStore(Database(str(tmp_path / "s.sqlite3"), max_age_s=DAY, max_bytes=10**6))
    running = dict(response("resp_run", ""), status="in_progress")
    assert store.start(running, [], background=True)
    delta = [{"type": "response.output_text.delta", "sequence_number": n, "delta": f"t{n} "} for n in range(3)]
    assert store.record(dict(running, output=[{"type": "message", "content": "t0 "}]), delta[:1])
    assert store.cancel("resp_run")["status"] == "cancelled"
    final = [{"type": "response.completed", "sequence_number": 3}]
    stored = store.finish(dict(running, output=[{"type": "message", "content": "t0 t1 t2 "}], status="completed"),
                          delta[1:], final, [])
    events, finished = store.events_after("resp_run", -1)
    assert finished and stored["status"] == "cancelled" and store.get("resp_run").response["status"] == "cancelled"
    assert "".join(event["delta"] for event in events) == stored["output"][0]["content"] == "t0 t1 t2 "

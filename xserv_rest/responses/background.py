"""Background responses: each runs on a thread of the worker process that created it, with no
client attached, recording its events and snapshots in the store (GET polls them, GET
?stream=true follows them, from any worker).

A cancel may arrive at any worker: it marks the run in the store, and the owning process's
watcher thread, which looks for such marks while the process has runs, closes the run's engine
call (the engine aborts the request and frees its KV blocks). The run then ends, stored as
cancelled with its output so far.
"""

import logging
import os
import threading
import time

from xserv_rest.responses.store import ResponseStore, process_owner
from xserv_rest.responses.stream import ResponseRun

log = logging.getLogger("xserv.rest")
CANCEL_POLL_S = 0.1


class BackgroundRuns:
    """One per worker process; threads start on first use (after gunicorn forks)."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._lock = threading.Lock()
        self._runs: dict[str, ResponseRun] = {}
        self._watcher_pid: int | None = None

    def start(self, run: ResponseRun) -> None:
        response_id = run.builder.response.id
        with self._lock:
            self._runs[response_id] = run
            if self._watcher_pid != os.getpid():
                self._watcher_pid = os.getpid()
                threading.Thread(target=self._watch, name="xserv-background-cancel", daemon=True).start()
        threading.Thread(target=self._run, args=(run,), name=f"xserv-{response_id}", daemon=True).start()

    def _run(self, run: ResponseRun) -> None:
        try:
            for _ in run.events():
                pass
        except Exception:
            log.exception("background response %s failed", run.builder.response.id)
        finally:
            with self._lock:
                self._runs.pop(run.builder.response.id, None)

    def _watch(self) -> None:
        owner = process_owner()
        while True:
            time.sleep(CANCEL_POLL_S)
            with self._lock:
                if not self._runs:
                    continue
            for response_id in self.store.cancelled(owner):
                with self._lock:
                    run = self._runs.get(response_id)
                if run is not None:
                    run.stop()

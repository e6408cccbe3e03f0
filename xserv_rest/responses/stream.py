"""A response being generated, event by event: ResponseRun drives the builder over the engine's
messages, and Recorder writes a stored response's events and snapshots to the store as they are
made (at most every FLUSH_S), so that GET, GET ?stream=true and cancel work from any worker.

A streamed response's WSGI body is its events as OpenAI's named SSE events (`event: <type>` then
its JSON, no [DONE]). The response is stored before its final event goes out, so a client that
reads response.completed finds it at once. When a foreground stream's client goes away the
server closes the body, which cancels the engine call, and nothing is kept.
"""

import json
import time
from typing import Callable, Iterator

from xserv_rest.errors import ApiError
from xserv_rest.generation import ClientGone, Generation
from xserv_rest.responses.builder import Event, ResponseBuilder
from xserv_rest.responses.store import ResponseStore

FLUSH_S = 0.2  # most time between two writes of a running response (what followers lag behind)
FOLLOW_POLL_S = 0.05


def event_frame(event: Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class Recorder:
    def __init__(self, store: ResponseStore, context: list[dict], keep_events: bool,
                 finished: Callable[[dict], None]):
        """`finished(response)` runs once the final response is stored (as stored: a cancelled
        run's status is cancelled)."""
        self.store = store
        self.context = context
        self.keep_events = keep_events
        self.finished = finished
        self._pending: list[Event] = []
        self._flushed_at = 0.0  # the first events go out at once
        self.started = False

    def start(self, response: dict, background: bool = False, max_background: int | None = None) -> bool:
        """Stores the response as running here; False when max_background runs are already on."""
        self.started = self.store.start(response, self.context, background, max_background)
        return self.started

    def add(self, response: dict, events: list[Event]) -> bool:
        """False when the response stopped running elsewhere (cancelled or deleted)."""
        if self.keep_events:
            self._pending += events
        if time.monotonic() - self._flushed_at < FLUSH_S:
            return True
        self._flushed_at = time.monotonic()
        events, self._pending = self._pending, []
        return self.store.record(response, events)

    def finish(self, response: dict, final: list[Event]) -> None:
        made, self._pending = self._pending, []
        if not self.started:  # a foreground response, not streamed: stored once it is done
            self.store.put(response, self.context)
            stored = response
        else:
            stored = self.store.finish(response, made, final if self.keep_events else [], self.context)
        if stored is not None:
            self.finished(stored)

    def discard(self, response_id: str) -> None:
        self.store.discard(response_id)


class ResponseRun:
    def __init__(self, builder: ResponseBuilder, generation: Generation, recorder: Recorder | None,
                 api_error: Callable[[BaseException], ApiError]):
        self.builder = builder
        self.generation = generation
        self.recorder = recorder
        self.api_error = api_error
        self.stopped = False

    def events(self) -> Iterator[Event]:
        """Every event, the final one last; an engine error ends the run with response.failed,
        a stop (cancel, delete) with no final event."""
        builder = self.builder
        if self.recorder and not self.recorder.started:
            self.recorder.start(builder.response.model_dump(mode="json"))
        try:
            yield from self._made(builder.start())
            for message in self.generation:
                yield from self._made(builder.add(message))
            final = builder.end()
        except (ClientGone, GeneratorExit):
            if self.recorder:
                self.recorder.discard(builder.response.id)
            raise
        except Exception as exc:
            final = [] if self.stopped else self._failed(exc)
        finally:
            self.generation.close()
        if self.recorder:
            self.recorder.finish(builder.response.model_dump(mode="json"), final)
        yield from final

    def stop(self) -> None:
        """Ends the engine call (the engine frees the request); the run ends with what it has."""
        self.stopped = True
        self.generation.close()

    def _failed(self, exc: Exception) -> list[Event]:
        error = self.api_error(exc)
        self.generation.metrics.stream_errors.labels(error.code or error.type).inc()
        return self.builder.fail(error)

    def _made(self, events: list[Event]) -> list[Event]:
        if self.recorder and not self.recorder.add(self.builder.response.model_dump(mode="json"), events):
            self.stop()  # cancelled or deleted elsewhere
        return events


class ResponseEventStream:
    """The WSGI body of a foreground streamed response."""

    def __init__(self, run: ResponseRun):
        self.run = run

    def __iter__(self) -> Iterator[bytes]:
        events = self.run.events()
        try:
            for event in events:
                yield event_frame(event)
        except ClientGone:
            return
        finally:
            events.close()  # the client went away mid-stream: the run learns it (GeneratorExit)

    def close(self) -> None:
        self.run.generation.close()


def follow(store: ResponseStore, response_id: str, after: int) -> Iterator[bytes]:
    """The recorded events of a stored streamed response numbered past `after`, then its live
    ones as its worker records them, until it ends."""
    while True:
        events, finished = store.events_after(response_id, after)
        yield from map(event_frame, events)
        if events:
            after = events[-1]["sequence_number"]
        elif finished:
            return
        else:
            time.sleep(FOLLOW_POLL_S)

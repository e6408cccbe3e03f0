"""Server-sent events: the frames of a streamed answer and the generator gunicorn writes out.

gunicorn closes the body when the client's socket fails or the stream ends; either way the
Generation is closed, cancelling the engine call.
"""

import json
from typing import Iterator

from xserv_rest.errors import to_api_error
from xserv_rest.generation import ClientGone, Generation

DONE = b"data: [DONE]\n\n"


def frame(event: dict) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream:
    """The WSGI body of a streamed answer: frames of `events`, then [DONE]; an error mid-stream
    is sent as one {"error": ...} event and ends the stream. The server calls close() however
    the response ends (even before the first frame), which cancels the engine call."""

    def __init__(self, events: Iterator[dict], generation: Generation, retry_after_s: int):
        self.events = events
        self.generation = generation
        self.retry_after_s = retry_after_s

    def __iter__(self) -> Iterator[bytes]:
        try:
            for event in self.events:
                yield frame(event)
            yield DONE
        except ClientGone:
            return
        except Exception as exc:
            error = to_api_error(exc, self.retry_after_s)
            self.generation.metrics.stream_errors.labels(error.code or error.type).inc()
            yield frame(error.body())
        finally:
            self.generation.close()

    def close(self) -> None:
        self.generation.close()

"""Server-sent events: the frames of a streamed answer and the generator gunicorn writes out.

gunicorn closes the body when the client's socket fails or the stream ends; either way the
Generation is closed, cancelling the engine call.
"""

import json
from typing import Iterator

from xserv_rest.errors import to_api_error
from xserv_rest.generation import ClientGone, Generation

DONE = b"data: [DONE]\n\n"


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def frame(event: dict) -> bytes:
    return b"data: " + _json(event).encode() + b"\n\n"


class Frames:
    """The chunk frames of one stream (the shape of ChatCompletionChunk or Completion). The
    head (id, object, created, model) is the same in every chunk, so it is serialized once and
    each chunk serializes only its choice: the hot path of a stream (benchmarks/sse_encode.py)."""

    def __init__(self, request_id: str, object: str, created: int, model: str, include_usage: bool):
        head = _json({"id": request_id, "object": object, "created": created, "model": model})
        self._choice_start = f"data: {head[:-1]},\"choices\":[{{\"index\":".encode()
        # As OpenAI: with include_usage every chunk carries "usage", null until the last one.
        self._choice_end = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._usage_start = f"data: {head[:-1]},\"choices\":[],\"usage\":".encode()

    def choice(self, index: int, fields: dict, usage: dict | None = None) -> bytes:
        """One chunk of one choice: {"index": index, **fields}; with `usage`, that instead of null
        (stream_options.continuous_usage_stats)."""
        end = self._choice_end if usage is None else b'],"usage":' + _json(usage).encode() + b"}\n\n"
        return b"".join((self._choice_start, str(index).encode(), b",", _json(fields)[1:].encode(), end))

    def usage(self, usage: dict) -> bytes:
        """The last chunk with include_usage: no choices, the request's usage."""
        return b"".join((self._usage_start, _json(usage).encode(), b"}\n\n"))


class EventStream:
    """The WSGI body of a streamed answer: `frames`, then [DONE]; an error mid-stream is sent as
    one {"error": ...} event and ends the stream. The server calls close() however the response
    ends (even before the first frame), which cancels the engine call."""

    def __init__(self, frames: Iterator[bytes], generation: Generation, retry_after_s: int):
        self.frames = frames
        self.generation = generation
        self.retry_after_s = retry_after_s

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.frames
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

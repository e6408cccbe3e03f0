"""Server-sent events: the frames of a streamed answer and the generator gunicorn writes out.

gunicorn closes the generator when the client's socket fails or the stream ends; either way its
`finally` closes the Generation, cancelling the engine call.
"""

import json
from typing import Iterator

from xserv_rest.errors import to_api_error
from xserv_rest.generation import ClientGone, Generation

DONE = b"data: [DONE]\n\n"


def frame(event: dict) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def event_stream(events: Iterator[dict], generation: Generation, retry_after_s: int) -> Iterator[bytes]:
    """Frames of `events`, then [DONE]; an error mid-stream is sent as one {"error": ...} event
    and ends the stream."""
    try:
        for event in events:
            yield frame(event)
        yield DONE
    except ClientGone:
        return
    except Exception as exc:
        yield frame(to_api_error(exc, retry_after_s).body())
    finally:
        generation.close()

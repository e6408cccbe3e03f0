"""The WSGI body of a streamed response: OpenAI's named events (`event: <type>` then its JSON),
no [DONE]. The response is stored before its final event goes out, so a client that reads
response.completed finds it at once. When the client goes away the server closes the body,
which cancels the engine call, and nothing is stored."""

import json
from typing import Callable, Iterator

from xserv_rest.errors import ApiError
from xserv_rest.generation import ClientGone, Generation
from xserv_rest.responses.builder import Event, ResponseBuilder
from xserv_rest.responses.objects import Response


def event_frame(event: Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseEventStream:
    def __init__(self, builder: ResponseBuilder, generation: Generation, finished: Callable[[Response], None],
                 api_error: Callable[[BaseException], ApiError]):
        self.builder = builder
        self.generation = generation
        self.finished = finished
        self.api_error = api_error

    def __iter__(self) -> Iterator[bytes]:
        builder = self.builder
        try:
            yield from map(event_frame, builder.start())
            for message in self.generation:
                yield from map(event_frame, builder.add(message))
            final = builder.end()
            self.finished(builder.response)
            yield from map(event_frame, final)
        except ClientGone:
            return
        except Exception as exc:
            error = self.api_error(exc)
            self.generation.metrics.stream_errors.labels(error.code or error.type).inc()
            yield from map(event_frame, builder.fail(error))
        finally:
            self.generation.close()

    def close(self) -> None:
        self.generation.close()

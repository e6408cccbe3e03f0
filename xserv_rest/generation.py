"""One engine Generate call on behalf of one HTTP request.

The call starts at once and is watched for the client hanging up; `first()` waits for the first
message so that errors the engine reports up front (bad field, queue full, not serving) become
the HTTP status of the response. `close()` cancels the call, which makes the engine abort the
request and free its KV blocks; cancelling a call that already ended does nothing. The call's
deadline is the front's request timeout; when it passes the engine aborts the request too.
"""

import queue
import threading
import time
from typing import Iterator

import grpc

from xserv.v1 import engine_pb2
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError
from xserv_rest.metrics import Metrics
from xserv_rest.render import UsageCounter


class ClientGone(ApiError):
    """The HTTP client hung up; nobody is left to read an answer."""

    def __init__(self):
        super().__init__(499, "client closed the connection", code="client_closed_request")


def timed_out(timeout_s: float) -> ApiError:
    return ApiError(504, f"the request did not finish within this server's request timeout of {timeout_s:g} s",
                    type="timeout", code="request_timeout")


class Generation:
    def __init__(self, engine: EngineClient, watcher: DisconnectWatcher, request: engine_pb2.GenerateRequest,
                 client_socket, metrics: Metrics, http_request_id: str | None = None):
        self.request_id = request.request_id
        self.client_gone = False
        self.metrics = metrics
        self._timeout_s = engine.request_timeout_s
        self._last_output = time.monotonic()
        self._seen_output = False
        self.usage = UsageCounter()  # the tokens the engine reported so far (the request's span)
        self._call = engine.generate(request, http_request_id)
        self._stop_watching = watcher.watch(client_socket, self._on_disconnect)
        self._first: engine_pb2.GenerateResponse | None = None

    def first(self) -> engine_pb2.GenerateResponse:
        try:
            self._first = self._next()
        except StopIteration:
            self.close()
            raise ApiError(500, "the engine ended the request without output", type="server_error") from None
        except BaseException:
            self.close()
            raise
        return self._first

    def __iter__(self) -> Iterator[engine_pb2.GenerateResponse]:
        """All messages, the one `first()` returned included."""
        if self._first is not None:
            yield self._first
        while True:
            try:
                yield self._next()
            except StopIteration:
                return

    def close(self) -> None:
        self._stop_watching()
        self._call.cancel()

    def _next(self) -> engine_pb2.GenerateResponse:
        try:
            message = next(self._call)
        except grpc.RpcError as exc:
            if self.client_gone:
                raise ClientGone() from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._timeout_s is not None:
                raise timed_out(self._timeout_s) from None
            raise
        self._observe(message)
        return message

    def _observe(self, message: engine_pb2.GenerateResponse) -> None:
        self.usage.add(message)
        now = time.monotonic()
        gap, self._last_output = now - self._last_output, now
        if not self._seen_output:
            self._seen_output = True
            self.metrics.ttft.observe(gap)
        elif message.token_ids:
            per_token = gap / len(message.token_ids)
            for _ in message.token_ids:
                self.metrics.itl.observe(per_token)

    def _on_disconnect(self) -> None:
        self.client_gone = True
        self._call.cancel()


class Generations:
    """The Generate calls of one HTTP request with several prompts (completions), read as one
    Generation: prompt p's choice i comes out as choice p * n + i. Each call is read on its own
    thread into one queue, so every choice streams as the engine makes it; an error in any call
    ends them all."""

    def __init__(self, engine: EngineClient, watcher: DisconnectWatcher, requests: list[engine_pb2.GenerateRequest],
                 n: int, client_socket, metrics: Metrics, http_request_id: str | None = None):
        self.metrics = metrics
        self.client_gone = False
        self._n = n
        self._parts = [Generation(engine, watcher, request, None, metrics, http_request_id) for request in requests]
        self._stop_watching = watcher.watch(client_socket, self._on_disconnect)

    @property
    def usage(self) -> UsageCounter:
        usage = UsageCounter()
        for part in self._parts:
            usage.merge(part.usage)
        return usage

    def first(self) -> None:
        try:
            for part in self._parts:
                part.first()
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[engine_pb2.GenerateResponse]:
        messages: queue.SimpleQueue = queue.SimpleQueue()
        for p, part in enumerate(self._parts):
            threading.Thread(target=_pump, args=(p, part, messages), daemon=True, name="xserv-prompt").start()
        running = len(self._parts)
        while running:
            p, message = messages.get()
            if message is None:
                running -= 1
            elif isinstance(message, BaseException):
                raise message
            else:
                message.index += p * self._n
                yield message

    def close(self) -> None:
        self._stop_watching()
        for part in self._parts:
            part.close()

    def _on_disconnect(self) -> None:
        self.client_gone = True
        for part in self._parts:
            part._on_disconnect()


def _pump(p: int, part: Generation, messages: queue.SimpleQueue) -> None:
    try:
        for message in part:
            messages.put((p, message))
        messages.put((p, None))
    except BaseException as exc:  # re-raised by the reader
        messages.put((p, exc))


def start(engine: EngineClient, watcher: DisconnectWatcher, requests: list[engine_pb2.GenerateRequest], n: int,
          client_socket, metrics: Metrics, http_request_id: str | None = None) -> Generation | Generations:
    """The engine calls of one HTTP request, started."""
    if len(requests) == 1:
        return Generation(engine, watcher, requests[0], client_socket, metrics, http_request_id)
    return Generations(engine, watcher, requests, n, client_socket, metrics, http_request_id)

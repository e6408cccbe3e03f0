"""One engine Generate call on behalf of one HTTP request.

The call starts at once and is watched for the client hanging up; `first()` waits for the first
message so that errors the engine reports up front (bad field, queue full, not serving) become
the HTTP status of the response. `close()` cancels the call, which makes the engine abort the
request and free its KV blocks; cancelling a call that already ended does nothing.
"""

from typing import Iterator

import grpc

from xserv.v1 import engine_pb2
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError


class ClientGone(ApiError):
    """The HTTP client hung up; nobody is left to read an answer."""

    def __init__(self):
        super().__init__(499, "client closed the connection", code="client_closed_request")


class Generation:
    def __init__(self, engine: EngineClient, watcher: DisconnectWatcher,
                 request: engine_pb2.GenerateRequest, client_socket):
        self.request_id = request.request_id
        self.client_gone = False
        self._call = engine.generate(request)
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
            return next(self._call)
        except grpc.RpcError:
            if self.client_gone:
                raise ClientGone() from None
            raise

    def _on_disconnect(self) -> None:
        self.client_gone = True
        self._call.cancel()

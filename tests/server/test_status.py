"""User errors become the status codes of the contract; internal causes never reach the client."""

import grpc
import pytest

from xserv_engine.errors import ContextTooLong, EngineOverloaded, EngineUnavailable, InvalidRequest
from xserv_engine.server.status import INTERNAL_MESSAGE, grpc_status


@pytest.mark.parametrize("exc, code, words", [
    (InvalidRequest("top_p", "must be in (0, 1], got 0.0"), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (ContextTooLong(9000, 16, 8192), grpc.StatusCode.INVALID_ARGUMENT, "8192"),
    (EngineOverloaded(4), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full"),
    (EngineUnavailable("engine is loading the model"), grpc.StatusCode.UNAVAILABLE, "loading"),
])
def test_user_errors_keep_their_message(exc, code, words):
    assert grpc_status(exc)[0] == code
    assert words in grpc_status(exc)[1]


def test_internal_errors_are_logged_not_leaked(caplog):
    code, message = grpc_status(RuntimeError("CUDA out of memory at 0xdeadbeef"))
    assert code == grpc.StatusCode.INTERNAL
    assert message == INTERNAL_MESSAGE and "deadbeef" not in message
    assert "deadbeef" in caplog.text

"""User errors become the status codes of the contract, with typed details; internal causes never
reach the client."""

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from xserv_engine.errors import ContextTooLong, EngineOverloaded, EngineUnavailable, InvalidRequest
from xserv_engine.server.status import CONTEXT_LENGTH_EXCEEDED, INTERNAL_MESSAGE, rpc_status_of


def details(status: grpc.Status) -> list:
    """Unpack the google.rpc.Status that travels in the grpc-status-details-bin trailer."""
    [(key, value)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    unpacked = []
    for detail in status_pb2.Status.FromString(value).details:
        for kind in (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo):
            if detail.Is(kind.DESCRIPTOR):
                message = kind()
                detail.Unpack(message)
                unpacked.append(message)
    return unpacked


@pytest.mark.parametrize("exc, code, words", [
    (InvalidRequest("top_p", "must be in (0, 1], got 0.0"), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (ContextTooLong(9000, 16, 8192), grpc.StatusCode.INVALID_ARGUMENT, "8192"),
    (EngineOverloaded(4), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full"),
    (EngineUnavailable("engine is loading the model"), grpc.StatusCode.UNAVAILABLE, "loading"),
])
def test_user_errors_keep_their_message(exc, code, words):
    status = rpc_status_of(exc)
    assert status.code == code
    assert words in status.details


def test_a_bad_field_is_named_in_a_bad_request_detail():
    [bad] = details(rpc_status_of(InvalidRequest("messages[2].content", "must be a string")))
    assert [(v.field, v.description) for v in bad.field_violations] == [("messages[2].content", "must be a string")]


@pytest.mark.parametrize("prompt_tokens, field", [(100, "max_tokens"), (9000, "input")])
def test_context_too_long_names_what_to_shorten_and_carries_the_numbers(prompt_tokens, field):
    bad, info = details(rpc_status_of(ContextTooLong(prompt_tokens, 8100, 8192)))
    assert [v.field for v in bad.field_violations] == [field]
    assert info.reason == CONTEXT_LENGTH_EXCEEDED
    assert dict(info.metadata) == {"prompt_tokens": str(prompt_tokens), "max_tokens": "8100", "max_model_len": "8192"}


def test_errors_without_a_field_carry_no_details():
    assert details(rpc_status_of(EngineOverloaded(4))) == []


def test_internal_errors_are_logged_with_their_traceback_not_leaked(caplog):
    try:
        raise RuntimeError("CUDA out of memory at 0xdeadbeef")
    except RuntimeError as exc:
        status = rpc_status_of(exc)
    assert status.code == grpc.StatusCode.INTERNAL
    assert status.details == INTERNAL_MESSAGE and "deadbeef" not in str(status.trailing_metadata)
    assert "Traceback" in caplog.text and "RuntimeError: CUDA out of memory at 0xdeadbeef" in caplog.text

"""The one place where engine errors become gRPC status codes."""

import logging

import grpc

from xserv_engine.errors import ContextTooLong, EngineOverloaded, EngineUnavailable, InvalidRequest

log = logging.getLogger("xserv.engine.server")

INTERNAL_MESSAGE = "internal engine error; see the engine log"


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception to (code, message). Messages of user errors start with the field name
    ("top_p: must be in (0, 1], got 0.0"); internal causes are logged here and never sent."""
    if isinstance(exc, (InvalidRequest, ContextTooLong)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "engine is not serving"
    log.error("internal error: %r", exc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE

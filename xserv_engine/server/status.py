"""The one place where engine errors become gRPC status, and the wrapper that applies it.

A user's mistake keeps its message and carries typed details (google.rpc.Status in the
`grpc-status-details-bin` trailer): INVALID_ARGUMENT a `google.rpc.BadRequest` whose field
violation names the field, a context that is too long also a `google.rpc.ErrorInfo` with the
numbers; UNIMPLEMENTED for another kind of model an ErrorInfo naming both kinds. An internal cause is logged with its traceback here and never sent.
"""

import functools
import inspect
import logging
from contextlib import aclosing

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from xserv_engine.errors import (ContextTooLong, EngineOverloaded, EngineUnavailable, InputTooLong, InvalidRequest,
                                 NotFound, Unsupported, WrongRunner)

log = logging.getLogger("xserv.engine.server")

INTERNAL_MESSAGE = "internal engine error; see the engine log"
ERROR_DOMAIN = "xserv.v1"
CONTEXT_LENGTH_EXCEEDED = "CONTEXT_LENGTH_EXCEEDED"
WRONG_RUNNER = "WRONG_RUNNER"  # ErrorInfo of a call for another kind of model: model, serves, wanted


def status_code(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, (InvalidRequest, ContextTooLong)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, Unsupported):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    return grpc.StatusCode.INTERNAL


def rpc_status_of(exc: BaseException) -> grpc.Status:
    """The status a call ends with when `exc` escapes its handler (logs internal causes)."""
    code = status_code(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error: %r", exc, exc_info=exc)
        message = INTERNAL_MESSAGE
    elif code == grpc.StatusCode.UNAVAILABLE:
        message = str(exc) or "engine is not serving"
    else:
        message = str(exc)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message,
                               details=[_pack(detail) for detail in _details(exc)])
    return rpc_status.to_status(status)


def _details(exc: BaseException) -> list:
    if isinstance(exc, (InvalidRequest, NotFound)):
        return [_bad_request(exc.field, exc.message)]
    if isinstance(exc, ContextTooLong):
        # the prompt alone fits: lowering max_tokens is the fix; otherwise the prompt is
        field = "max_tokens" if exc.prompt_tokens < exc.max_model_len else "input"
        if isinstance(exc, InputTooLong):
            field = exc.field
        info = error_details_pb2.ErrorInfo(reason=CONTEXT_LENGTH_EXCEEDED, domain=ERROR_DOMAIN, metadata={
            "prompt_tokens": str(exc.prompt_tokens), "max_tokens": str(exc.max_tokens),
            "max_model_len": str(exc.max_model_len)})
        return [_bad_request(field, str(exc)), info]
    if isinstance(exc, WrongRunner):
        return [error_details_pb2.ErrorInfo(reason=WRONG_RUNNER, domain=ERROR_DOMAIN, metadata={
            "model": exc.model_id, "serves": exc.serves, "wanted": exc.wanted})]
    return []


def _bad_request(field: str, description: str) -> error_details_pb2.BadRequest:
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
    return error_details_pb2.BadRequest(field_violations=[violation])


def _pack(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    status = rpc_status_of(exc)
    await context.abort(status.code, status.details, status.trailing_metadata)


def maps_errors(handler):
    """Wraps a servicer method, unary (async def) or streaming (async generator): an exception
    that escapes it ends the call with rpc_status_of(exc). The one try/except of the servicer."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(self, request, context):
            try:
                async with aclosing(handler(self, request, context)) as messages:
                    async for message in messages:
                        yield message
            except grpc.aio.AbortError:
                raise  # the handler aborted the call itself
            except Exception as exc:
                await abort(context, exc)

        return stream

    @functools.wraps(handler)
    async def unary(self, request, context):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)

    return unary

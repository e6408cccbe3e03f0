"""Errors, in one place: every failure becomes OpenAI's {"error": {message, type, param, code}}.

`to_api_error` maps any exception (our ApiError, a gRPC status, a Falcon HTTP error, a bug) to
an ApiError; `ErrorHandler` is the app's only error handler; sse.py uses the same mapping for
errors after a stream started. Internal causes are logged, never sent.
"""

import logging
import re

import falcon
import grpc

log = logging.getLogger("xserv.rest")

# The engine names the bad field first: "top_p: must be in (0, 1], got 0.0".
FIELD_MESSAGE = re.compile(r"^(?P<field>[A-Za-z_][\w.\[\]]*): (?P<message>.+)$", re.DOTALL)
CONTEXT_TOO_LONG = re.compile(r"context length|this model's context", re.IGNORECASE)
# "this model's maximum context length is 4096 tokens, but the request asks for 4200 (4000 in the
# prompt, 200 for the completion)": the prompt fits, so max_tokens is the field to lower.
PROMPT_FITS = re.compile(r"context length is (?P<limit>\d+) tokens.*?\((?P<prompt>\d+) in the prompt", re.DOTALL)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def to_api_error(exc: BaseException, retry_after_s: int, prompt_param: str = "messages") -> ApiError:
    """`prompt_param` names the prompt field in a context-too-long error (messages or prompt)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return _from_grpc(exc.code(), exc.details() or "", retry_after_s, prompt_param)
    if isinstance(exc, falcon.HTTPError):
        return _from_falcon(exc)
    log.error("internal error: %r", exc, exc_info=exc)
    return ApiError(500, "internal server error", type="server_error")


def _from_grpc(code: grpc.StatusCode, details: str, retry_after_s: int, prompt_param: str) -> ApiError:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if CONTEXT_TOO_LONG.search(details):
            fits = PROMPT_FITS.search(details)
            param = "max_tokens" if fits and int(fits["prompt"]) < int(fits["limit"]) else prompt_param
            return invalid_request(details, param=param, code="context_length_exceeded")
        match = FIELD_MESSAGE.match(details)
        if match:
            return invalid_request(details, param=match["field"])
        return invalid_request(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, details or "engine is overloaded; retry later", type="rate_limit_error",
                        code="engine_overloaded", headers={"Retry-After": str(retry_after_s)})
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, "the engine is unavailable (starting, draining or down); retry later",
                        type="service_unavailable", code="engine_unavailable")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        # The front's own credentials are wrong: a server misconfiguration, not the client's fault.
        log.error("the engine rejected this front's gRPC token (--grpc-token): %s", details)
        return ApiError(500, "the REST front is misconfigured: the engine rejected its gRPC token",
                        type="server_error", code="engine_auth_failed")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, "the engine did not answer in time", type="timeout", code="timeout")
    log.error("engine call failed: %s %s", code, details)
    return ApiError(500, "internal server error", type="server_error")


def _from_falcon(exc: falcon.HTTPError) -> ApiError:
    status = exc.status_code
    message = exc.description or exc.title or "error"
    if status == 404:
        return ApiError(404, message or "not found", code="not_found")
    if status == 413:
        return ApiError(413, message, code="request_too_large")
    headers = dict(exc.headers or {})
    return ApiError(status, message, headers=headers)


class ErrorHandler:
    """The app's one error handler (falcon add_error_handler for Exception and HTTPError)."""

    def __init__(self, retry_after_s: int):
        self.retry_after_s = retry_after_s

    def __call__(self, req: falcon.Request, resp: falcon.Response, exc: BaseException, params) -> None:
        prompt_param = "prompt" if req.path.rstrip("/") == "/v1/completions" else "messages"
        error = to_api_error(exc, self.retry_after_s, prompt_param)
        resp.status = error.status
        resp.media = error.body()
        resp.stream = None
        for name, value in error.headers.items():
            resp.set_header(name, value)

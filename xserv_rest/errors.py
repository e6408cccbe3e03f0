"""Errors, in one place: every failure becomes OpenAI's {"error": {message, type, param, code}}.

`to_api_error` maps any exception (our ApiError, a gRPC status, a Falcon HTTP error, a bug) to
an ApiError; `ErrorHandler` is the app's only error handler; sse.py uses the same mapping for
errors after a stream started. Internal causes are logged, never sent. The engine names a bad
field in a google.rpc.BadRequest detail of its INVALID_ARGUMENT status, never only in the text.
"""

import logging
import re

import falcon
import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from pydantic import BaseModel, ValidationError

from xserv_rest.protocol.errors import ErrorDetail, ErrorResponse, describe

log = logging.getLogger("xserv.rest")

CONTEXT_LENGTH_EXCEEDED = "CONTEXT_LENGTH_EXCEEDED"  # the engine's ErrorInfo reasons
WRONG_RUNNER = "WRONG_RUNNER"
# a call for another kind of model, in REST terms, by the engine's runner kinds (WRONG_RUNNER's
# serves and wanted): what the endpoint does, what the model is, what to start for the endpoint
_SERVICE = {"generate": "text generation", "pooling": "embeddings", "score": "reranking or scores"}
_KIND = {"generate": "a generation model", "pooling": "an embedding model (/v1/embeddings)",
         "score": "a reranker (/rerank, /score)"}
_START = {"generate": "a generation model (such as Qwen3-8B): xserv up --model DIR",
          "pooling": "an embedding model (such as Qwen3-Embedding-0.6B): xserv up --model DIR --runner pooling",
          "score": "a reranker (such as Qwen3-Reranker-0.6B): xserv up --model DIR --runner score"}


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
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid_body(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    """A request body its protocol model refused: 400 naming the field ("messages[2].content")."""
    message, param, code = describe(exc, model)
    return invalid_request(message, param=param, code=code)


def to_api_error(exc: BaseException, retry_after_s: int, prompt_param: str = "messages") -> ApiError:
    """`prompt_param` names the prompt field in a context-too-long error (messages or prompt)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return _invalid_argument(exc, prompt_param)
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return _unimplemented(exc)
        return _from_grpc(exc.code(), exc.details() or "", retry_after_s)
    if isinstance(exc, falcon.HTTPError):
        return _from_falcon(exc)
    log.error("internal error: %r", exc, exc_info=exc)
    return ApiError(500, "internal server error", type="server_error")


def _invalid_argument(call: grpc.Call, prompt_param: str) -> ApiError:
    """The field and the kind come from the status's details (BadRequest, ErrorInfo), never from
    parsing the message; the engine's field name becomes the REST body's."""
    field, reasons = _details(call)
    param = rest_param(field, prompt_param) if field else None
    code = "context_length_exceeded" if CONTEXT_LENGTH_EXCEEDED in reasons else None
    message = call.details() or "invalid request"
    if field and param and message.startswith(f"{field}: "):  # InvalidRequest's "field: message", in REST names
        message = f"{param}: {message.removeprefix(f'{field}: ')}"
    return invalid_request(message, param=param, code=code)


def _unimplemented(call: grpc.Call) -> ApiError:
    """The engine serves another kind of model (generation, embeddings or a reranker): said in REST
    terms from its WRONG_RUNNER detail, else in the engine's words."""
    wrong = _details(call)[1].get(WRONG_RUNNER, {})
    if wrong.get("serves") in _KIND and wrong.get("wanted") in _START:
        message = (f"this model does not serve {_SERVICE[wrong['wanted']]}: {wrong.get('model', 'it')} is "
                   f"{_KIND[wrong['serves']]}; for this endpoint start xserv with {_START[wrong['wanted']]}")
    else:
        message = call.details() or "the served model does not implement this endpoint"
    return invalid_request(message, param="model")


def _details(call: grpc.Call) -> tuple[str | None, dict[str, dict[str, str]]]:
    """(the first BadRequest field violation's field, {ErrorInfo reason: its metadata}) of a call's
    status."""
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # details that contradict the call's own code: trust neither
        return None, {}
    field, reasons = None, {}
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            field = field or next((v.field for v in bad_request.field_violations), None)
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reasons[info.reason] = dict(info.metadata)
    return field, reasons


# the engine's names that the REST body spells differently (constraints: response_format's and
# structured_outputs' spellings of json_schema, regex, grammar, choice)
_REST_NAMES = {"template_kwargs_json": "chat_template_kwargs", "json_schema": "response_format",
               "regex": "structured_outputs", "grammar": "structured_outputs", "choice": "structured_outputs"}
_EMBED_INPUT = re.compile(r"inputs(\[\d+\])?(\..*)?")  # "inputs", "inputs[3]", "inputs[3].text", ...


def rest_param(field: str, prompt_param: str) -> str:
    """The engine's field names (GenerateRequest's) -> the REST body's: "chat.messages[2].content"
    -> "messages[2].content", "chat.messages[2].parts[1]" -> "messages[2].content[1]", "text" or "token_ids" -> "prompt"; completions' top_logprobs is
    its "logprobs"; EmbedRequest's "inputs[3].text" -> "input[3]", "inputs" -> "input". ScoreRequest's
    names (query, documents[3], instruction) are /rerank's already; /score renames them itself."""
    embed_input = _EMBED_INPUT.fullmatch(field)
    if embed_input:
        return "input" + (embed_input.group(1) or "")
    field = field.removeprefix("chat.").replace(".parts[", ".content[")  # a message's parts are its content's
    if field in ("text", "token_ids", "input", "messages") or field.startswith("token_ids["):
        return prompt_param
    if field == "top_logprobs" and prompt_param == "prompt":
        return "logprobs"
    return _REST_NAMES.get(field, field)


def _from_grpc(code: grpc.StatusCode, details: str, retry_after_s: int) -> ApiError:
    if code == grpc.StatusCode.NOT_FOUND:
        # a LoRA adapter the engine has not loaded (unloaded since this worker's model info was fetched)
        return ApiError(404, details or "the model does not exist", param="model", code="model_not_found")
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
    if status == 405:  # Falcon's title only ("405 Method Not Allowed"); ErrorHandler says which method
        return ApiError(405, "this method is not allowed here", code="method_not_allowed", headers=dict(exc.headers or {}))
    headers = dict(exc.headers or {})
    return ApiError(status, message, headers=headers)


# the body field that holds an endpoint's prompt, where it is not "messages" (engine errors about
# text or token_ids name it; /tokenize's chat form names messages[...] itself)
PROMPT_PARAMS = {"/v1/completions": "prompt", "/tokenize": "prompt", "/detokenize": "tokens",
                 "/v1/embeddings": "input"}


class ErrorHandler:
    """The app's one error handler (falcon add_error_handler for Exception and HTTPError)."""

    def __init__(self, retry_after_s: int):
        self.retry_after_s = retry_after_s

    def __call__(self, req: falcon.Request, resp: falcon.Response, exc: BaseException, params) -> None:
        prompt_param = PROMPT_PARAMS.get(req.path.rstrip("/"), "messages")
        error = to_api_error(exc, self.retry_after_s, prompt_param)
        if error.code == "method_not_allowed":
            takes = [m for m in error.headers.get("Allow", "").split(", ") if m and m != "OPTIONS"]
            error.message = f"{req.method} is not allowed on {req.path}; it takes {' or '.join(takes)}"
        # a resource may spell a param its own way for this request (one embeddings input: input[0] -> input)
        error.param = req.context.get("param_names", {}).get(error.param, error.param)
        resp.status = error.status
        resp.media = error.body()
        resp.stream = None
        for name, value in error.headers.items():
            resp.set_header(name, value)

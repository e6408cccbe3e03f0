"""The OpenAPI 3.1 document served at GET /openapi.json, generated from the protocol models.

Every schema under components comes from a model's model_json_schema (OpenAPI 3.1 speaks JSON
Schema 2020-12, which pydantic writes), so the document is what the server enforces; only the
paths, their summaries and status codes are written here. The runtime limits (--max-n, the
engine's context) are the same Limits the validation context carries.
"""

from pydantic.json_schema import models_json_schema

from xserv_rest.config import RestConfig
from xserv_rest.protocol.base import Limits
from xserv_rest.protocol.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from xserv_rest.protocol.completions import Completion, CompletionRequest
from xserv_rest.protocol.embeddings import EmbeddingList, EmbeddingRequest
from xserv_rest.protocol.errors import ErrorResponse
from xserv_rest.protocol.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from xserv_rest.protocol.models import ModelCard, ModelList
from xserv_rest.protocol.rerank import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from xserv_rest.protocol.tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                          TokenizerInfo)
from xserv_rest.routes import ROUTES, openapi_paths

REF = "#/components/schemas/{model}"
REQUESTS = (ChatCompletionRequest, CompletionRequest)
ANSWERS = (ChatCompletion, ChatCompletionChunk, Completion, ModelCard, ModelList, ErrorResponse)
ERRORS = {
    "400": "invalid request (param names the field), incl. context_length_exceeded",
    "401": "invalid_api_key: Authorization: Bearer <key> missing or wrong",
    "404": "model_not_found: no served model or loaded LoRA adapter has that name",
    "413": "request_too_large: body larger than --max-body-bytes",
    "429": "engine_overloaded: the engine's queue is full; see Retry-After",
    "500": "server_error (incl. engine_auth_failed: the engine rejected the front's gRPC token)",
    "503": "engine_unavailable: loading, draining or down",
    "504": "request_timeout: not finished within --request-timeout",
}
# With an event stream, OpenAPI 3.1's schema describes each event.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a JSON chunk (ChatCompletionChunk, or Completion for /v1/completions), an "
                                    "ErrorResponse after a failure mid-stream, or [DONE] last"}}}
EXAMPLES = {
    "ChatCompletionRequest": {
        "hello": {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32},
        "streamed": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                     "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9},
        "thinking_off": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                         "chat_template_kwargs": {"enable_thinking": False}, "top_k": 20, "seed": 1, "n": 2},
    },
    "TokenizeRequest": {
        "text": {"prompt": "Hello world"},
        "chat": {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": False}},
    },
    "DetokenizeRequest": {"ids": {"tokens": [9707, 1879]}},
    "EmbeddingRequest": {
        "text": {"input": "The food was delicious and the waiter was friendly."},
        "batch": {"input": ["first text", "second text"], "dimensions": 32, "encoding_format": "base64"},
        "token_ids": {"input": [[9707, 1879], [9707]], "encoding_format": "float"},
    },
    "RerankRequest": {
        "strings": {"query": "What is the capital of France?", "top_n": 2,
                    "documents": ["Paris is the capital of France.", "Berlin is in Germany.", "France is in Europe."]},
        "objects": {"query": "capital of France", "documents": [{"text": "Paris is the capital of France."}],
                    "return_documents": False, "instruction": "Given a question, find the passage that answers it"},
    },
    "ScoreRequest": {
        "one": {"text_1": "What is the capital of France?", "text_2": "Paris is the capital of France."},
        "many": {"text_1": ["capital of France"], "text_2": ["Paris is the capital of France.", "Berlin"]},
    },
    "CompletionRequest": {
        "text": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2},
        "token_ids": {"prompt": [9707, 11], "max_tokens": 4, "stop": ["\n"]},
    },
}


TOKENIZER_REQUESTS = (TokenizeRequest, DetokenizeRequest)
TOKENIZER_ANSWERS = (TokenizeResponse, DetokenizeResponse, TokenizerInfo)
OTHER_REQUESTS = TOKENIZER_REQUESTS + (EmbeddingRequest, RerankRequest, ScoreRequest, LoadLoraAdapterRequest,
                                       UnloadLoraAdapterRequest)
OTHER_ANSWERS = TOKENIZER_ANSWERS + (EmbeddingList, RerankResponse, ScoreResponse)


def component_schemas(limits: Limits) -> dict:
    """Requests as validated, answers as serialized; nested models become their own entries."""
    modes = ([(model, "validation") for model in REQUESTS + OTHER_REQUESTS]
             + [(model, "serialization") for model in ANSWERS + OTHER_ANSWERS])
    _, top = models_json_schema(modes, ref_template=REF)
    schemas = top["$defs"]
    for request in REQUESTS:
        properties = schemas[request.__name__]["properties"]
        _lower_maximum(properties["n"], limits.max_n)
        if limits.max_model_len:  # the prompt takes at least one token of the context
            for name in ("max_tokens", "max_completion_tokens"):
                _lower_maximum(properties[name], limits.max_model_len - 1)
    if limits.embedding_size:
        _lower_maximum(schemas["EmbeddingRequest"]["properties"]["dimensions"], limits.embedding_size)
    return schemas


def _lower_maximum(optional: dict, maximum: int) -> None:
    number = optional["anyOf"][0]
    number["maximum"] = min(number["maximum"], maximum)


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}


def json_body(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def error_responses(codes: list[str]) -> dict:
    return {code: dict(json_body(_ref("ErrorResponse")), description=ERRORS[code]) for code in sorted(codes)}


def generation_path(summary: str, request: str, answer: str, secured: bool) -> dict:
    ok = {"description": "the answer (JSON), or with stream: true server-sent events ending in data: [DONE]; "
                         "an error after the stream started is one data: {\"error\": ...} event",
          "content": {"application/json": {"schema": _ref(answer)}, "text/event-stream": {"schema": SSE_EVENT}}}
    codes = ["400", "404", "413", "429", "500", "503", "504"] + (["401"] if secured else [])
    return {"post": {
        "summary": summary, "operationId": request,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": _ref(request), "examples": {name: {"value": value} for name, value in EXAMPLES[request].items()}}}},
        "responses": {"200": ok, **error_responses(codes)}}}


def model_paths(secured: bool) -> dict:
    auth = ["401"] if secured else []
    return {
        "/v1/models": {"get": {"summary": "the served model", "operationId": "listModels", "responses": {
            "200": json_body(_ref("ModelList")) | {"description": "the model list"},
            **error_responses(["500", "503"] + auth)}}},
        "/v1/models/{model}": {"get": {
            "summary": "the served model, by id", "operationId": "retrieveModel",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": json_body(_ref("ModelCard")) | {"description": "the model"},
                          **error_responses(["404", "500", "503"] + auth)}}},
    }


def tokenizer_paths(secured: bool) -> dict:
    """vLLM's tokenizer endpoints."""
    auth = ["401"] if secured else []

    def post(summary: str, request: str, answer: str) -> dict:
        examples = {name: {"value": value} for name, value in EXAMPLES[request].items()}
        return {"post": {"summary": summary, "operationId": request, "requestBody": {
            "required": True, "content": {"application/json": {"schema": _ref(request), "examples": examples}}},
            "responses": {"200": json_body(_ref(answer)) | {"description": summary},
                          **error_responses(["400", "404", "413", "500", "503"] + auth)}}}

    return {
        "/tokenize": post("token ids of a text or of a rendered chat", "TokenizeRequest", "TokenizeResponse"),
        "/detokenize": post("the text of token ids", "DetokenizeRequest", "DetokenizeResponse"),
        "/tokenizer_info": {"get": {
            "summary": "special tokens and chat template", "operationId": "tokenizerInfo",
            "responses": {"200": json_body(_ref("TokenizerInfo")) | {"description": "info"},
                          **error_responses(["500", "503"] + auth)}}},
    }


def embeddings_path(secured: bool) -> dict:
    examples = {name: {"value": value} for name, value in EXAMPLES["EmbeddingRequest"].items()}
    codes = ["400", "404", "413", "429", "500", "503", "504"] + (["401"] if secured else [])
    return {"post": {
        "summary": "embeddings of texts or token ids (an embedding model, served with --runner pooling)",
        "operationId": "EmbeddingRequest", "requestBody": {"required": True, "content": {"application/json": {
            "schema": _ref("EmbeddingRequest"), "examples": examples}}},
        "responses": {"200": json_body(_ref("EmbeddingList")) | {"description": "one embedding per input, in order"},
                      **error_responses(codes)}}}


def scoring_paths(secured: bool) -> dict:
    """vLLM's reranking endpoints, under each path routes.py gives them."""
    codes = ["400", "404", "413", "429", "500", "503", "504"] + (["401"] if secured else [])

    def post(operation: str, summary: str, request: str, answer: str, description: str) -> dict:
        examples = {name: {"value": value} for name, value in EXAMPLES[request].items()}
        return {"post": {"summary": summary, "operationId": operation, "requestBody": {
            "required": True, "content": {"application/json": {"schema": _ref(request), "examples": examples}}},
            "responses": {"200": json_body(_ref(answer)) | {"description": description}, **error_responses(codes)}}}

    rerank = ("documents ranked by relevance to a query (a reranker, served with --runner score)", "RerankRequest",
              "RerankResponse", "the documents' results, most relevant first")
    score = ("relevance scores of documents to a query (a reranker, served with --runner score)", "ScoreRequest",
             "ScoreResponse", "one score per text_2 document, in order")
    described = {"rerank": rerank, "score": score}
    return {route.path: post(_operation_id(route.resource, route.path), *described[route.resource])
            for route in ROUTES if route.resource in described}


def _operation_id(name: str, path: str) -> str:
    """rerank for /rerank, rerankV1 for /v1/rerank."""
    version = path.split("/")[1]
    return name if version == name else name + version.capitalize()


def lora_paths(secured: bool) -> dict:
    """vLLM's runtime LoRA endpoints; each answers one plain-text line."""
    auth = ["401"] if secured else []

    def post(summary: str, request: str, done: str, codes: list[str]) -> dict:
        ok = {"description": f"Success: LoRA adapter '<lora_name>' {done} successfully.",
              "content": {"text/plain": {"schema": {"type": "string"}}}}
        return {"post": {"summary": summary, "operationId": request, "requestBody": {
            "required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": ok, **error_responses(codes + auth)}}}

    return {
        "/v1/load_lora_adapter": post("load a LoRA adapter (a PEFT directory on the engine's machine)",
                                      "LoadLoraAdapterRequest", "added", ["400", "413", "500", "503", "504"]),
        "/v1/unload_lora_adapter": post("unload a LoRA adapter", "UnloadLoraAdapterRequest", "removed",
                                        ["400", "404", "413", "500", "503"]),
    }


def openapi_document(config: RestConfig, max_model_len: int | None = None,
                     embedding_size: int | None = None) -> dict:
    secured = bool(config.api_keys)
    document = {
        "openapi": "3.1.0",
        "info": {"title": "xserv OpenAI-compatible REST API", "version": "1"},
        "paths": {
            "/v1/chat/completions": generation_path("chat completion", "ChatCompletionRequest", "ChatCompletion",
                                                    secured),
            "/v1/completions": generation_path("text completion", "CompletionRequest", "Completion", secured),
            "/v1/embeddings": embeddings_path(secured),
            **scoring_paths(secured),
            **model_paths(secured),
            **tokenizer_paths(secured),
            **lora_paths(secured),
            "/health": {"get": {"summary": "200 while the engine serves", "operationId": "health", "security": [],
                                "responses": {"200": json_body({"type": "object"}) | {"description": "serving"},
                                              **error_responses(["503"])}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics", "security": [],
                                 "responses": {"200": {"description": "Prometheus text format", "content": {
                                     "text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": component_schemas(Limits(config.max_n, max_model_len, embedding_size))},
    }
    if secured:
        document["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearerAuth": []}]
    from xserv_rest.responses.openapi import add_responses  # here: it builds on this module's helpers

    add_responses(document, secured, Limits(config.max_n, max_model_len))
    described = document["paths"]
    assert set(described) == set(openapi_paths()), set(described) ^ set(openapi_paths())
    document["paths"] = {path: described[path] for path in openapi_paths()}
    return document

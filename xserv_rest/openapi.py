"""The OpenAPI 3.1 document of the REST API, served at GET /openapi.json.

Built from the tables below, which follow what schemas.py and the engine accept (types, ranges,
required fields); tests/rest/test_openapi.py sends every example to the server and runs
schemathesis against the document, so the two stay in agreement.
"""

from xserv_rest.config import RestConfig
from xserv_rest.schemas import MAX_STOP

U32 = 2**32 - 1


def nullable(schema: dict) -> dict:
    """The schema, or null (OpenAI clients send null for "unset")."""
    if "oneOf" in schema:
        return dict(schema, oneOf=schema["oneOf"] + [{"type": "null"}])
    if "const" in schema:
        return {k: v for k, v in schema.items() if k != "const"} | {"enum": [schema["const"], None]}
    if "enum" in schema:
        return dict(schema, enum=schema["enum"] + [None])
    return dict(schema, type=[schema["type"], "null"])


def object_schema(properties: dict, required: tuple[str, ...] = (), **extra) -> dict:
    """An object whose optional properties may also be null; unknown properties are ignored."""
    return {"type": "object", "required": list(required), **extra,
            "properties": {name: schema if name in required else nullable(schema)
                           for name, schema in properties.items()}}


def integer(minimum: int, maximum: int, description: str) -> dict:
    return {"type": "integer", "minimum": minimum, "maximum": maximum, "description": description}


def number(minimum: float, maximum: float, description: str, exclusive_minimum: bool = False) -> dict:
    low = {"exclusiveMinimum": minimum} if exclusive_minimum else {"minimum": minimum}
    return {"type": "number", **low, "maximum": maximum, "description": description}


def boolean(description: str) -> dict:
    return {"type": "boolean", "description": description}


def token_ids(description: str, min_items: int = 0) -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": U32},
            "minItems": min_items, "description": description}


def sampling(max_n: int) -> dict:
    """Fields chat and completions share."""
    return {
        "model": {"type": "string", "description": "the served model id (GET /v1/models); may be omitted"},
        "max_tokens": integer(1, U32, "most tokens to generate; past the context: 400 context_length_exceeded"),
        "max_completion_tokens": integer(1, U32, "the same as max_tokens; wins when both are given"),
        "temperature": number(0, 2, "0 is greedy"),
        "top_p": number(0, 1, "nucleus sampling mass", exclusive_minimum=True),
        "n": integer(1, max_n, "choices to generate (at most --max-n)"),
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP}],
                 "description": "stop strings, not included in the output"},
        "seed": integer(0, 2**64 - 1, "sampling seed"),
        "presence_penalty": number(-2, 2, "OpenAI presence penalty"),
        "frequency_penalty": number(-2, 2, "OpenAI frequency penalty"),
        "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                       "description": "token id (as a string) -> bias added to its logit"},
        "stream": boolean("answer as server-sent events"),
        "stream_options": object_schema({"include_usage": boolean("a last chunk with the usage and no choices")},
                                        description="only with stream: true"),
        "user": {"type": "string", "description": "accepted and ignored"},
        "top_k": integer(-1, 2**31 - 1, "vLLM extra: -1 or 0 disables"),
        "min_p": number(0, 1, "vLLM extra"),
        "repetition_penalty": number(0, 2, "vLLM extra", exclusive_minimum=True),
        "min_tokens": integer(0, U32, "vLLM extra: tokens generated before EOS may end the answer"),
        "ignore_eos": boolean("vLLM extra"),
        "skip_special_tokens": boolean("vLLM extra"),
        "include_stop_str_in_output": boolean("vLLM extra"),
        "stop_token_ids": token_ids("vLLM extra: token ids that end the answer"),
    }


def needs_true(field: str, name: str) -> dict:
    """`field`, when given (not null), needs `name: true`."""
    return {"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
            "then": {"required": [name], "properties": {name: {"const": True}}}}


TEXT_PART = object_schema({"type": {"const": "text"}, "text": {"type": "string"}}, required=("type",))
TOOL_CALL = object_schema({
    "id": {"type": "string"}, "type": {"type": "string", "description": "function"},
    "function": object_schema({"name": {"type": "string"}, "arguments": {
        "oneOf": [{"type": "string"}, {"type": "object"}], "description": "a JSON string (or a JSON object)"}})})
MESSAGE = object_schema(required=("role",), properties={
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"], "description": "developer reads as system"},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}],
                "description": "a string or text parts (no images)"},
    "name": {"type": "string"}, "tool_call_id": {"type": "string"},
    "reasoning_content": {"type": "string"}, "reasoning": {"type": "string", "description": "vLLM's name"},
    "tool_calls": {"type": "array", "items": TOOL_CALL}})


def chat_request(max_n: int) -> dict:
    properties = dict(sampling(max_n), **{
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "logprobs": boolean("return the chosen tokens' logprobs"),
        "top_logprobs": integer(0, 20, "alternatives per token; needs logprobs: true"),
        "tools": {"type": "array", "items": {"type": "object"}, "description": "OpenAI tool definitions"},
        "tool_choice": {"oneOf": [{"type": "string"}, object_schema(required=("function",), properties={
            "type": {"const": "function"},
            "function": object_schema({"name": {"type": "string", "minLength": 1}}, required=("name",))})]},
        "add_generation_prompt": boolean("vLLM extra"),
        "chat_template_kwargs": object_schema({"enable_thinking": {"type": "boolean"}},
                                              description="arguments for the chat template, e.g. enable_thinking"),
    })
    return object_schema(properties, required=("messages",),
                         allOf=[needs_true("stream_options", "stream"), needs_true("top_logprobs", "logprobs")])


def completion_request(max_n: int) -> dict:
    properties = dict(sampling(max_n), **{
        "prompt": {"oneOf": [
            {"type": "string"}, token_ids("token ids", min_items=1),
            {"type": "array", "minItems": 1, "maxItems": 1,
             "items": {"oneOf": [{"type": "string"}, token_ids("token ids", min_items=1)]}}],
            "description": "one prompt: a string, token ids, or a list holding one of them"},
        "logprobs": integer(0, 20, "alternatives per token to return"),
        "echo": {"const": False, "description": "not supported"},
    })
    properties["max_tokens"] = dict(properties["max_tokens"], default=16)
    schema = object_schema(properties, required=("prompt",), allOf=[needs_true("stream_options", "stream")])
    schema["properties"]["suffix"] = {"type": "null", "description": "not supported"}
    return schema


ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# With an event stream, OpenAPI 3.1's schema describes each event.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a JSON chunk (chat.completion.chunk or text_completion), an "
                                    "{\"error\": ...} object after a failure mid-stream, or [DONE] last"}}}
ANSWER = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"]}
ERRORS = {
    "400": "invalid request (param names the field), incl. context_length_exceeded",
    "401": "invalid_api_key: Authorization: Bearer <key> missing or wrong",
    "404": "model_not_found: model is not the served one",
    "413": "request_too_large: body larger than --max-body-bytes",
    "429": "engine_overloaded: the engine's queue is full; see Retry-After",
    "500": "server_error (incl. engine_auth_failed: the engine rejected the front's gRPC token)",
    "503": "engine_unavailable: loading, draining or down",
    "504": "request_timeout: not finished within --request-timeout",
}
CHAT_EXAMPLES = {
    "hello": {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32},
    "streamed": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                 "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9},
    "thinking_off": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                     "chat_template_kwargs": {"enable_thinking": False}, "top_k": 20, "seed": 1, "n": 2},
}
COMPLETION_EXAMPLES = {
    "text": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2},
    "token_ids": {"prompt": [9707, 11], "max_tokens": 4, "stop": ["\n"]},
}


def json_body(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def error_responses(codes: list[str]) -> dict:
    return {code: dict(json_body({"$ref": "#/components/schemas/Error"}), description=ERRORS[code])
            for code in codes}


def generation_path(summary: str, schema: str, examples: dict, secured: bool) -> dict:
    answer = {"description": "the answer (JSON), or with stream: true server-sent events ending in "
                             "data: [DONE]; an error after the stream started is one data: {\"error\": ...} event",
              "content": {"application/json": {"schema": ANSWER},
                          "text/event-stream": {"schema": SSE_EVENT}}}
    codes = ["400", "404", "413", "429", "500", "503", "504"] + (["401"] if secured else [])
    return {"post": {
        "summary": summary, "operationId": schema,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"},
            "examples": {name: {"value": value} for name, value in examples.items()}}}},
        "responses": {"200": answer, **error_responses(sorted(codes))}}}


def openapi_document(config: RestConfig) -> dict:
    secured = bool(config.api_keys)
    models = {"get": {"summary": "the served model", "operationId": "listModels", "responses": {
        "200": json_body({"type": "object", "required": ["object", "data"]}) | {"description": "the model list"},
        **error_responses(["500", "503"] + (["401"] if secured else []))}}}
    model = {"get": {"summary": "the served model, by id", "operationId": "retrieveModel",
                     "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                     "responses": {
        "200": json_body({"type": "object", "required": ["id", "object"]}) | {"description": "the model"},
        **error_responses(["404", "500", "503"] + (["401"] if secured else []))}}}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "xserv OpenAI-compatible REST API", "version": "1"},
        "paths": {
            "/v1/chat/completions": generation_path("chat completion", "ChatCompletionRequest", CHAT_EXAMPLES, secured),
            "/v1/completions": generation_path("text completion", "CompletionRequest", COMPLETION_EXAMPLES, secured),
            "/v1/models": models,
            "/v1/models/{model}": model,
            "/health": {"get": {"summary": "200 while the engine serves", "operationId": "health", "security": [],
                                "responses": {"200": json_body({"type": "object"}) | {"description": "serving"},
                                              **error_responses(["503"])}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics", "security": [],
                                 "responses": {"200": {"description": "Prometheus text format", "content": {
                                     "text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": {"ChatCompletionRequest": chat_request(config.max_n),
                                   "CompletionRequest": completion_request(config.max_n), "Error": ERROR}},
    }
    if secured:
        document["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearerAuth": []}]
    return document

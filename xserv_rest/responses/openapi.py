"""The Responses API's part of /openapi.json: its paths, and its schemas from the models (the
request as validated, the response as serialized)."""

import json

from pydantic.json_schema import models_json_schema

from xserv_rest.protocol.base import Limits
from xserv_rest.protocol.openapi import REF, SSE_EVENT, error_responses, json_body
from xserv_rest.conversations.openapi import CONVERSATION_MODELS, conversation_paths
from xserv_rest.responses.objects import DeletedResponse, ItemList, Response
from xserv_rest.responses.pages import list_parameters
from xserv_rest.responses.request import ResponsesRequest, chat_accepts

EXAMPLES = {
    "hello": {"input": "Hello!", "max_output_tokens": 32},
    "items": {"instructions": "Be brief.", "stream": True, "reasoning": {"effort": "none"}, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
        "tools": [{"type": "function", "name": "get_weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "store": False},
}
CREATE_ERRORS = ["400", "404", "413", "429", "500", "503", "504"]
STREAM = dict(SSE_EVENT, description="named events (event: <type>), each data a JSON event with its "
                                     "sequence_number; the last is response.completed, response.incomplete or "
                                     "response.failed")


def responses_schemas(limits: Limits) -> dict:
    modes = [(ResponsesRequest, "validation"), (Response, "serialization"), (DeletedResponse, "serialization"),
             (ItemList, "serialization"), *CONVERSATION_MODELS]
    _, top = models_json_schema(modes, ref_template=REF)
    schemas = top["$defs"]
    _accepted_only(schemas)
    if limits.max_model_len:  # the input takes at least one token of the context
        limit = schemas["ResponsesRequest"]["properties"]["max_output_tokens"]["anyOf"][0]
        limit["maximum"] = min(limit["maximum"], limits.max_model_len - 1)
    return schemas


def _accepted_only(schemas: dict) -> None:
    """tool_choice, parallel_tool_calls and text.format as far as the chat request takes them
    (structured outputs decide how far)."""
    properties = schemas["ResponsesRequest"]["properties"]
    choices = properties["tool_choice"]["anyOf"]
    choices[0]["enum"] = [value for value in choices[0]["enum"] if chat_accepts(tool_choice=value)]
    if not chat_accepts(tool_choice={"type": "function", "name": "f"}):
        choices.remove({"$ref": REF.format(model="NamedFunction")})
    if not chat_accepts(parallel_tool_calls=False):
        properties["parallel_tool_calls"]["anyOf"][0] = {"const": True}
    format_type = schemas["TextFormat"]["properties"]["type"]
    format_type["enum"] = [value for value in format_type["enum"] if chat_accepts(text={"format": {"type": value}})]
    if not chat_accepts(text={"verbosity": "medium"}):
        schemas["TextConfig"]["properties"]["verbosity"] = {"type": "null", "description": "not supported"}


def responses_paths(secured: bool) -> dict:
    auth = ["401"] if secured else []
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    created = {"description": "the response (JSON), or with stream: true its events",
               "content": {"application/json": {"schema": {"$ref": REF.format(model="Response")}},
                           "text/event-stream": {"schema": STREAM}}}
    retrieve = response_id + [
        {"name": "stream", "in": "query", "schema": {"type": "boolean"}, "description": "true: the events of a "
         "response created with stream: true (replayed, then followed live until it ends)"},
        {"name": "starting_after", "in": "query", "schema": {"type": "integer", "minimum": -1},
         "description": "with stream: the events after this sequence_number"}]
    return {
        **conversation_paths(secured),
        "/v1/responses/{response_id}/cancel": {"post": {
            "summary": "cancel a background response", "operationId": "cancelResponse", "parameters": response_id,
            "responses": {"200": json_body({"$ref": REF.format(model="Response")}) | {
                "description": "the response, cancelled"}, **error_responses(["400", "404"] + auth)}}},
        "/v1/responses/{response_id}/input_items": {"get": {
            "summary": "the input items of a stored response (its whole context)", "operationId": "listInputItems",
            "parameters": response_id + list_parameters(),
            "responses": {"200": json_body({"$ref": REF.format(model="ItemList")}) | {"description": "a page of items"},
                          **error_responses(["400", "404"] + auth)}}},
        "/v1/responses": {"post": {
            "summary": "create a response", "operationId": "ResponsesRequest",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": REF.format(model="ResponsesRequest")},
                "examples": {name: {"value": value} for name, value in EXAMPLES.items()}}}},
            "responses": {"200": created, **error_responses(CREATE_ERRORS + auth)}}},
        "/v1/responses/{response_id}": {
            "get": {"summary": "a stored response, or its events", "operationId": "retrieveResponse",
                    "parameters": retrieve,
                    "responses": {"200": created | {"description": "the response (JSON), or with stream=true its "
                                                                   "events"},
                                  **error_responses(["400", "404"] + auth)}},
            "delete": {"summary": "delete a stored response", "operationId": "deleteResponse",
                       "parameters": response_id,
                       "responses": {"200": json_body({"$ref": REF.format(model="DeletedResponse")}) | {
                           "description": "deleted"}, **error_responses(["404"] + auth)}}},
    }


def add_responses(document: dict, secured: bool, limits: Limits) -> dict:
    """The document with the Responses API's paths and schemas added. A schema named like a
    different one already there (another endpoint's TextFormat, say) is added as Responses<Name>."""
    schemas = document["components"]["schemas"]
    mine = responses_schemas(limits)
    renamed = {name: f"Responses{name}" for name, schema in mine.items() if schemas.get(name, schema) != schema}
    part = json.dumps({"schemas": mine, "paths": responses_paths(secured)})
    for name, new_name in renamed.items():
        part = part.replace(json.dumps(REF.format(model=name)), json.dumps(REF.format(model=new_name)))
    part = json.loads(part)
    schemas.update({renamed.get(name, name): schema for name, schema in part["schemas"].items()})
    document["paths"].update(part["paths"])
    return document

"""Structured outputs in the REST bodies: OpenAI's response_format, vLLM's structured_outputs
extra and the forcing tool_choice values. The engine enforces them (a grammar mask) and refuses a
schema it cannot enforce, naming the keyword: never a silently weaker constraint."""

import json
from typing import Annotated, Any, Literal

from google.protobuf import empty_pb2
from pydantic import ConfigDict, Field, model_validator

from xserv.v1 import engine_pb2
from xserv_rest.protocol.base import FieldError, Model
from xserv_rest.protocol.sampling import SamplingRequest


class ResponseFormatText(Model):
    type: Literal["text"]


class ResponseFormatJsonObject(Model):
    type: Literal["json_object"] = Field(description="any JSON object")


class JsonSchemaSpec(Model):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema; none: any JSON object")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormatJsonSchema(Model):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                          Field(discriminator="type")]


def _given(name: str) -> dict:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# JSON Schema for the cross-field rule of ConstrainedRequest._one_constraint: with structured_outputs,
# response_format is absent or text (the request models add it to their allOf)
ONE_FORMAT = {"if": _given("structured_outputs"), "then": {"properties": {"response_format": {
    "anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}}


class StructuredOutputs(Model):
    """vLLM's extra body field: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(populate_by_name=True,
                              json_schema_extra={"oneOf": [_given(name) for name in CONSTRAINTS]})
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = Field(None, description="the whole answer matches it (Rust regex syntax)")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1,
                                                                     description="the answer is one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")
    json_object: Literal[True] | None = Field(None, description="any JSON object")
    whitespace_flexible: bool | None = Field(None, description="xserv extra: free whitespace in JSON "
                                                               "(default: compact)")

    def given(self) -> list[str]:
        return [name for name in CONSTRAINTS if getattr(self, "json_" if name == "json" else name) is not None]


class FunctionName(Model):
    name: str = Field(description="one of the offered tools (checked by the engine)")


class NamedToolChoice(Model):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


def tool_choice_name(choice: ToolChoice | None) -> str:
    """The engine's spelling: auto | none | required | the function's name."""
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice or ""


class ConstrainedRequest(SamplingRequest):
    """A request whose answer may be held to a format (chat and completions)."""

    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extra: json, regex, choice "
                                                                           "or grammar")

    @model_validator(mode="after")
    def _one_constraint(self) -> "ConstrainedRequest":
        if self.structured_outputs is None:
            return self
        given = self.structured_outputs.given()
        if len(given) != 1:
            raise FieldError("structured_outputs", "set exactly one of json, regex, choice, grammar or "
                             f"json_object (got {', '.join(given) or 'none'})")
        if self.response_format is not None and self.response_format.type != "text":
            raise FieldError("structured_outputs", "cannot be combined with a response_format other than text")
        return self

    def constrain(self, params: engine_pb2.SamplingParams) -> None:
        """Set params' constraint oneof from structured_outputs or response_format."""
        if self.structured_outputs is not None:
            _set_structured(params, self.structured_outputs)
        elif isinstance(self.response_format, ResponseFormatJsonSchema) and self.response_format.json_schema.schema_:
            params.json_schema = json.dumps(self.response_format.json_schema.schema_, ensure_ascii=False)
        elif isinstance(self.response_format, (ResponseFormatJsonObject, ResponseFormatJsonSchema)):
            params.json_object.CopyFrom(empty_pb2.Empty())  # a json_schema without a schema: any object


def _set_structured(params: engine_pb2.SamplingParams, so: StructuredOutputs) -> None:
    params.whitespace_flexible = bool(so.whitespace_flexible)
    if so.json_ is not None:
        params.json_schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_, ensure_ascii=False)
    elif so.regex is not None:
        params.regex = so.regex
    elif so.choice is not None:
        params.choice.choices.extend(so.choice)
    elif so.grammar is not None:
        params.grammar = so.grammar
    else:
        params.json_object.CopyFrom(empty_pb2.Empty())

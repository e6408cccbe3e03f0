"""Structured outputs as OpenAI SDK users meet them: `xserv up` on the random demo model, where
only the mask makes an answer valid."""

import json
import subprocess
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.structured.schemas import PARAMETERS, TOOLS
from tests.support.processes import served

pytestmark = pytest.mark.e2e

MODEL = "xserv-demo-qwen3-random"  # the demo model's served id
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
QUESTION = [{"role": "user", "content": "Who are you? And what is the weather in Oslo?"}]


class Address(BaseModel):
    city: str = Field(max_length=10)
    floor: int = Field(ge=0, le=40)


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    role: Literal["admin", "user", "guest"]
    tags: list[Annotated[str, Field(max_length=6)]] = Field(min_length=1, max_length=3)
    address: Address


@pytest.fixture(scope="module")
def sdk():
    with served("up", "--workers", "1", "--threads", "8", "--num-kv-blocks", "256", "--max-model-len", "1024",
                "--dtype", "float32", "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        yield openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_the_pydantic_object(sdk):
    for _ in range(2):
        completion = sdk.chat.completions.parse(model=MODEL, messages=QUESTION, response_format=Person,
                                                max_tokens=200, extra_body=NO_THINKING)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_streamed_json_schema_answers_validate(sdk):
    schema = Person.model_json_schema()  # closed objects, as the SDK's strict schemas are
    for model in (schema, *schema["$defs"].values()):
        model["additionalProperties"] = False
    stream = sdk.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200, stream=True, extra_body=NO_THINKING, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["stop", "stop"]
    for text in texts:
        Person.model_validate_json(text)


def test_required_tool_choice_gives_valid_calls(sdk):
    completion = sdk.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                             max_tokens=300, extra_body=NO_THINKING)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_named_tool_choice_streams_exactly_that_call(sdk):
    stream = sdk.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, stream=True, max_tokens=200, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, extra_body=NO_THINKING)
    names, arguments, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                assert call.index == 0
                names += [call.function.name] if call.function.name else []
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert names == ["get_time"] and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), PARAMETERS["get_time"])


def test_completions_take_vllm_structured_outputs(sdk):
    completion = sdk.completions.create(model=MODEL, prompt="Pick one:", max_tokens=20,
                                        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert completion.choices[0].text in ("red", "green", "blue")
    completion = sdk.completions.create(model=MODEL, prompt="A code:", max_tokens=20,
                                        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}})
    assert len(completion.choices[0].text) == 5 and completion.choices[0].finish_reason == "stop"


def test_an_unsupported_schema_keyword_is_a_400_naming_it(sdk):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "ids", "schema": schema}})
    assert error.value.body["param"] == "response_format" and "uniqueItems" in error.value.body["message"]

"""response_format, vLLM's structured_outputs and forcing tool_choice values reach the engine
as its constraint fields; malformed or conflicting ones are a 400 naming the field."""

import json

import pytest
from google.protobuf import empty_pb2

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def engine_params(client, fake, path=CHAT, **body):
    body = {"messages": USER, **body} if path == CHAT else {"prompt": "hi", **body}
    resp = client.simulate_post(path, json=body)
    assert resp.status_code == 200, resp.text
    return fake.engine.requests[-1]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_response_format_becomes_the_engine_s_constraint(client, fake, path):
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    params = engine_params(client, fake, path, response_format=schema_format).params
    assert json.loads(params.json_schema) == SCHEMA and not params.whitespace_flexible
    params = engine_params(client, fake, path, response_format={"type": "json_object"}).params
    assert params.WhichOneof("constraint") == "json_object"
    params = engine_params(client, fake, path, response_format={"type": "text"}).params
    assert params.WhichOneof("constraint") is None


@pytest.mark.parametrize("structured, field, value", [
    ({"json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
    ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"grammar": 'start: "a"'}, "grammar", 'start: "a"'),
    ({"json_object": True}, "json_object", empty_pb2.Empty()),
])
def test_vllm_structured_outputs_become_the_engine_s_constraint(client, fake, structured, field, value):
    params = engine_params(client, fake, structured_outputs=structured).params
    assert params.WhichOneof("constraint") == field and getattr(params, field) == value
    choice = engine_params(client, fake, structured_outputs={"choice": ["a", "b"], "whitespace_flexible": True}).params
    assert list(choice.choice.choices) == ["a", "b"] and choice.whitespace_flexible


def test_forcing_tool_choices_reach_the_engine(client, fake):
    chat = engine_params(client, fake, tools=[TOOL], tool_choice="required").chat
    assert chat.tool_choice == "required" and not chat.HasField("parallel_tool_calls")
    chat = engine_params(client, fake, tools=[TOOL], parallel_tool_calls=False,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}}).chat
    assert chat.tool_choice == "get_weather" and chat.parallel_tool_calls is False


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_a_malformed_or_conflicting_constraint_is_400_naming_it(client, fake, body, param):
    before = len(fake.engine.requests)
    resp = client.simulate_post(CHAT, json={"messages": USER, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json["error"]["param"].startswith(param)
    assert len(fake.engine.requests) == before

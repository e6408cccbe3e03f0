"""Structured outputs through the real `xserv engine` process: the grpc stubs and grpcurl."""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from google.protobuf import empty_pb2
from xserv.v1 import engine_pb2

from tests.server.engine_process import GRPCURL, start_engine
from tests.structured.schemas import PARAMETERS, PERSON, PERSON_JSON, TOOLS
from tests.support.grpc_errors import bad_fields

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    process = start_engine(tmp_path_factory)
    yield process
    assert process.stop() == 0


def generate(engine, timeout: float = 240, **fields) -> list[engine_pb2.GenerateResponse]:
    request = engine_pb2.GenerateRequest(**fields)
    return list(engine.stub.Generate(request, timeout=timeout))


def person_request(**params) -> dict:
    return dict(text="A person as JSON:", params=engine_pb2.SamplingParams(
        max_tokens=200, temperature=1.0, json_schema=PERSON_JSON, **params))


def test_32_concurrent_schema_answers_validate_through_grpc(engine):
    with ThreadPoolExecutor(32) as pool:
        streams = list(pool.map(lambda _: generate(engine, **person_request()), range(32)))
    for messages in streams:
        assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads("".join(m.text for m in messages)), PERSON)
    assert engine.wait_all_blocks_free().kv_blocks_free == engine.model_info().kv_blocks_total


def test_json_object_regex_and_choice_through_grpc(engine):
    plain = dict(max_tokens=40, temperature=1.0)
    obj = generate(engine, text="JSON:", params=engine_pb2.SamplingParams(
        json_object=empty_pb2.Empty(), **plain))
    if obj[-1].finish_reason == engine_pb2.FINISH_REASON_STOP:
        assert isinstance(json.loads("".join(m.text for m in obj)), dict)
    else:
        assert "".join(m.text for m in obj).startswith("{")
    regex = generate(engine, text="Code:", params=engine_pb2.SamplingParams(regex="[A-Z]{3}-[0-9]{4}", **plain))
    assert len("".join(m.text for m in regex)) == 8
    choice = generate(engine, text="Sure?", params=engine_pb2.SamplingParams(
        choice=engine_pb2.ChoiceList(choices=["yes", "no"]), **plain))
    assert "".join(m.text for m in choice) in ("yes", "no")


def test_an_uncompilable_schema_is_invalid_argument_naming_the_field(engine):
    bad = engine_pb2.SamplingParams(max_tokens=10, json_schema='{"type": "array", "uniqueItems": true}')
    with pytest.raises(grpc.RpcError) as error:
        generate(engine, text="Hi", params=bad)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [(field, description)] = bad_fields(error.value)
    assert field == "json_schema" and "uniqueItems" in description
    assert engine.model_info().num_waiting == 0


def test_a_named_tool_call_is_forced_through_grpc(engine):
    chat = engine_pb2.ChatInput(
        messages=[engine_pb2.ChatMessage(role="user", content="Weather in Oslo?")],
        tools=[json.dumps(tool) for tool in TOOLS], tool_choice="get_weather", parallel_tool_calls=False,
        enable_thinking=False)
    messages = generate(engine, chat=chat, params=engine_pb2.SamplingParams(max_tokens=200, temperature=1.0))
    assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS
    deltas = [d for m in messages for d in m.tool_calls]
    assert {d.index for d in deltas} == {0} and deltas[0].name == "get_weather"
    jsonschema.validate(json.loads("".join(d.arguments for d in deltas)), PARAMETERS["get_weather"])


def json_stream(text: str) -> list[dict]:
    """grpcurl's output: one pretty-printed JSON object per message."""
    decoder, messages, position = json.JSONDecoder(), [], 0
    while text[position:].strip():
        message, position = decoder.raw_decode(text, len(text) - len(text[position:].lstrip()))
        messages.append(message)
    return messages


def test_the_documented_grpcurl_example_works(engine):
    # docs/grpc.md, "Structured outputs"
    data = json.dumps({"text": "Is the sky blue?", "params": {
        "max_tokens": 20, "json_schema": json.dumps({
            "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
            "additionalProperties": False})}})
    out = subprocess.run([GRPCURL, "-plaintext", "-d", data, engine.address, "xserv.v1.EngineService/Generate"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    messages = json_stream(out)
    text = "".join(m.get("text", "") for m in messages)
    assert json.loads(text) in ({"answer": "yes"}, {"answer": "no"}), out
    assert messages[-1]["finish_reason"] == "FINISH_REASON_STOP"

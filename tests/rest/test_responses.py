"""/v1/responses through `xserv rest` under gunicorn in front of the fake engine, spoken to with
the openai SDK: what the engine is asked, the response object, the event stream, the store."""

import json

import openai
import pytest
import requests

from tests.support.processes import served
from xserv_rest.protocol.base import Limits
from xserv_rest.responses.openapi import add_responses

from .fake_grpc_engine import MODEL_ID

pytestmark = pytest.mark.e2e

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"type": "web_search"}]
# What the fake engine streams for a prompt ending in "tools": reasoning, then one call.
TOOL_EVENTS = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.content_part.added",
    "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.function_call_arguments.delta",
    "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.output_item.done", "response.completed"]


def responses_front(fake, store: str, workers: int = 1):
    return served("rest", "--engine", fake.address, "--workers", str(workers), "--threads", "8",
                  "--responses-store", store, "--log-level", "warning", timeout_s=30)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("responses") / "responses.sqlite3")


@pytest.fixture(scope="module")
def url(fake, store_path):
    with responses_front(fake, store_path, workers=2) as two_workers:
        yield two_workers.url


@pytest.fixture(scope="module")
def sdk(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def last_chat(fake) -> list[tuple]:
    messages = fake.engine.requests[-1].chat.messages
    return [(m.role, m.content, m.reasoning_content, [(c.id, c.name, c.arguments) for c in m.tool_calls],
             m.tool_call_id) for m in messages]


def comparable(response, same_run: bool = False) -> dict:
    """A response without what differs between two runs (ids, times) unless `same_run`, and
    without what the SDK's stream helper adds (parsed, parsed_arguments)."""
    body = response.model_dump(exclude=None if same_run else {"id", "created_at", "completed_at"})
    for item in body["output"]:
        item.pop("parsed_arguments", None)
        for part in item.get("content") or ():
            part.pop("parsed", None)
        if not same_run:
            item.pop("id")
    return body


def test_string_input_with_instructions(sdk, fake):
    response = sdk.responses.create(model=MODEL_ID, input="Say hello", instructions="Be brief")
    assert response.status == "completed" and response.output_text == "Hello world"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.usage.input_tokens == 7 and response.usage.input_tokens_details.cached_tokens == 3
    assert response.usage.output_tokens == 4 and response.usage.total_tokens == 11
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert last_chat(fake) == [("system", "Be brief", "", [], ""), ("user", "Say hello", "", [], "")]


def test_item_input_becomes_the_chat(sdk, fake):
    response = sdk.responses.create(model=MODEL_ID, input=[
        {"role": "developer", "content": "Answer in English"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi, "},
                                                         {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "again"}])
    assert response.output_text == "Hello world"
    assert last_chat(fake) == [("system", "Answer in English", "", [], ""), ("user", "Hi, there", "", [], ""),
                               ("assistant", "Hello!", "", [], ""), ("user", "again", "", [], "")]


def test_stream_sends_the_events_in_order_and_ends_with_the_created_response(sdk):
    with sdk.responses.stream(model=MODEL_ID, input="use tools", tools=TOOLS, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.type for event in events] == TOOL_EVENTS
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"city": "Paris"}' == events[12].arguments
    created = sdk.responses.create(model=MODEL_ID, input="use tools", tools=TOOLS, temperature=0)
    assert comparable(final) == comparable(created)
    assert comparable(sdk.responses.retrieve(final.id), same_run=True) == comparable(final, same_run=True)


def test_reasoning_and_function_call_items_only_function_tools_offered(sdk, fake):
    response = sdk.responses.create(model=MODEL_ID, input="use tools", tools=TOOLS)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I should call the tool."
    assert reasoning.summary == [] and reasoning.status == "completed"
    assert (call.type, call.call_id, call.name, call.status) == ("function_call", "call_1", "get_weather",
                                                                 "completed")
    assert json.loads(call.arguments) == {"city": "Paris"}
    tools = [json.loads(tool) for tool in fake.engine.requests[-1].chat.tools]
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                       "parameters": TOOLS[0]["parameters"]}}]
    assert [tool.type for tool in response.tools] == ["function", "web_search"]


def test_previous_response_id_continues_the_conversation(sdk, fake):
    first = sdk.responses.create(model=MODEL_ID, input="use tools", tools=TOOLS, instructions="Be brief")
    second = sdk.responses.create(model=MODEL_ID, previous_response_id=first.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert second.previous_response_id == first.id and second.output_text == "Hello world"
    call = ("call_1", "get_weather", '{"city": "Paris"}')
    expected = [("user", "use tools", "", [], ""), ("assistant", "", "I should call the tool.", [call], ""),
                ("tool", "sunny", "", [], "call_1")]
    assert last_chat(fake) == expected  # the instructions are not carried over
    third = sdk.responses.create(model=MODEL_ID, previous_response_id=second.id, input="thanks")
    assert last_chat(fake) == expected + [("assistant", "Hello world", "", [], ""), ("user", "thanks", "", [], "")]
    assert third.status == "completed"


def test_retrieve_and_delete(sdk, url):
    response = sdk.responses.create(model=MODEL_ID, input="hi", metadata={"team": "a"})
    for _ in range(4):  # whichever worker answers
        assert sdk.responses.retrieve(response.id).model_dump() == response.model_dump()
    assert response.metadata == {"team": "a"}
    deleted = requests.delete(f"{url}/v1/responses/{response.id}", timeout=10)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as error:
        sdk.responses.retrieve(response.id)
    assert error.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(response.id)


def test_store_false_leaves_nothing(sdk):
    response = sdk.responses.create(model=MODEL_ID, input="hi", store=False)
    assert response.output_text == "Hello world" and response.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as error:
        sdk.responses.create(model=MODEL_ID, input="hi", previous_response_id=response.id)
    assert error.value.body["param"] == "previous_response_id"


def test_incomplete_when_max_output_tokens_runs_out(sdk):
    response = sdk.responses.create(model=MODEL_ID, input="hi", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Hello" and response.output[0].status == "incomplete"
    with sdk.responses.stream(model=MODEL_ID, input="hi", max_output_tokens=2) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0]"),
    ({"input": [{"type": []}]}, "input[0]"),
    ({"input": "hi", "tools": ["web_search"]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"input": "hi", "conversation": "conv_unknown"}, "conversation"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice.type"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({}, "input"),
])
def test_refusals_name_the_field(url, body, param):
    answer = requests.post(f"{url}/v1/responses", json=body, timeout=10)
    assert answer.status_code in (400, 404)
    error = answer.json()["error"]
    assert error["param"] == param and param.split("[")[0] in error["message"]


def test_engine_errors_keep_their_status(sdk):
    with pytest.raises(openai.RateLimitError):
        sdk.responses.create(model=MODEL_ID, input="error:overloaded")
    with pytest.raises(openai.NotFoundError) as error:
        sdk.responses.create(model="gpt-5", input="hi")
    assert error.value.body["code"] == "model_not_found"


def test_error_mid_stream_ends_with_response_failed(sdk):
    with sdk.responses.stream(model=MODEL_ID, input="midstream") as stream:
        events = list(stream)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "engine_unavailable"
    assert events[-3].type == "response.output_text.delta" and events[-3].delta == "partial"


def test_client_disconnect_cancels_the_engine_call(url, fake):
    with requests.post(f"{url}/v1/responses", json={"input": "slow", "stream": True}, stream=True,
                       timeout=10) as answer:
        lines = answer.iter_lines()
        while b"response.output_text.delta" not in next(lines):
            pass
    assert fake.engine.wait_cancelled("resp_", timeout_s=10) is not None


def test_a_stored_response_survives_a_restart_of_the_front(fake, tmp_path):
    store = str(tmp_path / "kept.sqlite3")
    with responses_front(fake, store) as first:
        sdk = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        response = sdk.responses.create(model=MODEL_ID, input="hi")
    with responses_front(fake, store) as restarted:
        sdk = openai.OpenAI(base_url=restarted.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert sdk.responses.retrieve(response.id).model_dump() == response.model_dump()
        follow_up = sdk.responses.create(model=MODEL_ID, input="again", previous_response_id=response.id)
        assert follow_up.status == "completed"



def test_logprobs_of_the_answer_text(sdk, fake):
    with sdk.responses.stream(model=MODEL_ID, input="hi", include=["message.output_text.logprobs"],
                              top_logprobs=2) as stream:
        deltas = [event for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    params = fake.engine.requests[-1].params
    assert params.logprobs and params.top_logprobs == 2
    logprobs = final.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == [d.delta for d in deltas] == ["Hel", "lo", " wor", "ld"]
    assert [len(lp.top_logprobs) for lp in logprobs] == [2] * 4 and logprobs[0].bytes == list(b"Hel")
    assert [d.logprobs[0].token for d in deltas] == ["Hel", "lo", " wor", "ld"]
    assert sdk.responses.create(model=MODEL_ID, input="hi").output[0].content[0].logprobs == []


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUESTION = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("responses, chat", [
    ({"text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}}),
    ({"text": {"format": {"type": "json_object"}}}, {"response_format": {"type": "json_object"}}),
    ({"tools": TOOLS[:1], "tool_choice": "required"}, {"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather", "parameters": TOOLS[0]["parameters"]}}],
        "tool_choice": "required"}),
    ({"tools": TOOLS[:1], "tool_choice": {"type": "function", "name": "get_weather"}}, {"tools": [{
        "type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                         "parameters": TOOLS[0]["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ({"reasoning": {"effort": "minimal"}, "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9},
     {"chat_template_kwargs": {"enable_thinking": False}, "max_completion_tokens": 9, "temperature": 0.5,
      "top_p": 0.9}),
    ({"reasoning": {"effort": "high"}, "parallel_tool_calls": False},
     {"chat_template_kwargs": {"enable_thinking": True}, "parallel_tool_calls": False}),
])
def test_the_engine_gets_what_the_same_chat_request_would_give_it(url, fake, responses, chat):
    """The Responses fields are the chat endpoint's in other words: both get the same engine
    request, or both the same refusal, under each API's name for the field."""
    by_responses = requests.post(f"{url}/v1/responses", json=dict(responses, input=[QUESTION]), timeout=10)
    engine_request = fake.engine.requests[-1]
    by_chat = requests.post(f"{url}/v1/chat/completions", json=dict(chat, messages=[QUESTION]), timeout=10)
    assert by_responses.status_code == by_chat.status_code
    if by_chat.status_code == 200:
        engine_request.request_id = fake.engine.requests[-1].request_id
        assert engine_request == fake.engine.requests[-1]
    else:
        names = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}
        chat_param = by_chat.json()["error"]["param"]
        assert by_responses.json()["error"]["param"] == names.get(chat_param, chat_param)


def test_a_schema_named_like_another_endpoint_s_is_added_under_its_own_name():
    document = {"components": {"schemas": {"TextFormat": {"type": "string"}}}, "paths": {}}
    schemas = add_responses(document, False, Limits())["components"]["schemas"]
    assert schemas["TextFormat"] == {"type": "string"} and schemas["ResponsesTextFormat"]["title"] == "TextFormat"
    assert schemas["TextConfig"]["properties"]["format"]["anyOf"][0] == {"$ref": "#/components/schemas/"
                                                                                 "ResponsesTextFormat"}
    assert set(document["paths"]) == {
        "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
        "/v1/responses/{response_id}/input_items", "/v1/conversations", "/v1/conversations/{conversation_id}",
        "/v1/conversations/{conversation_id}/items", "/v1/conversations/{conversation_id}/items/{item_id}"}

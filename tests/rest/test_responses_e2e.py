"""/v1/responses end to end: `xserv up` on a scripted model, spoken to with the openai SDK and
run by an openai-agents agent.

The scripted model answers a thinking prompt with reasoning, a sentence and a get_weather call,
and a prompt that ends in the empty think block with a plain sentence. Its chat template (the
official one, changed here) closes the think block after a tool result, so the turn after a
call answers in plain text, as a real model would after reading the tool's result.
"""

import asyncio
import json
import subprocess
from typing import Literal

import openai
import pytest
from openai.types.shared import Reasoning
from pydantic import BaseModel

from tests.support.processes import served
from tests.support.reference import QWEN3
from tests.support.scripted_model import script_tokens, write_scripted_model
from xserv_engine.tokenizer.chat_tokens import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START
from xserv_engine.tokenizer.tokenizer import Tokenizer

from .test_responses import comparable

pytestmark = [pytest.mark.e2e, pytest.mark.reference]

OFFICIAL_TEMPLATE = QWEN3 / "chat_template.jinja"
NO_THINKING = "enable_thinking is defined and enable_thinking is false"
REASONING = "The user wants the weather in Paris"
CONTENT = "Let me check."
CALL_PIECES = ('{"name":"get_weather","arguments":{"city":', '"Paris"}}')
PLAIN = "Hello there, no thinking here!"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_dir):
    template = OFFICIAL_TEMPLATE.read_text()
    assert NO_THINKING in template
    template = template.replace(NO_THINKING, f"({NO_THINKING}) or messages[-1].role == 'tool'")
    tokenizer = Tokenizer.from_dir(demo_dir)
    thinking = script_tokens(tokenizer, "\n", THINK_START, REASONING, THINK_END, CONTENT,
                             TOOL_CALL_START, *CALL_PIECES, TOOL_CALL_END)
    no_thinking = script_tokens(tokenizer, "\n\n", PLAIN)
    path = tmp_path_factory.mktemp("scripted")
    write_scripted_model(path, demo_dir, [thinking, no_thinking], chat_template=template)
    return path


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    with served("up", "--model", str(model_dir), "--workers", "2", "--threads", "8", "--num-kv-blocks", "64",
                "--max-model-len", "1024", "--dtype", "float32", "--responses-store", str(store),
                "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        yield up.url


@pytest.fixture(scope="module")
def sdk(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(sdk):
    return sdk.models.list().data[0].id


def test_thinking_gives_a_reasoning_item_a_message_and_a_call(sdk, model):
    response = sdk.responses.create(model=model, input=QUESTION, tools=TOOLS, max_output_tokens=200)
    reasoning, message, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and response.output_text == CONTENT
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    usage = response.usage
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert response.status == "completed"


def test_effort_none_answers_without_reasoning(sdk, model):
    response = sdk.responses.create(model=model, input=QUESTION, tools=TOOLS, reasoning={"effort": "none"})
    [message] = response.output
    assert message.type == "message" and response.output_text == PLAIN
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.reasoning.effort == "none"


def test_stream_ends_with_the_response_create_gives(sdk, model):
    with sdk.responses.stream(model=model, input=QUESTION, tools=TOOLS, temperature=0) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    created = sdk.responses.create(model=model, input=QUESTION, tools=TOOLS, temperature=0)
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    for kind in ("reasoning_text", "output_text", "function_call_arguments"):
        assert f"response.{kind}.delta" in types and f"response.{kind}.done" in types
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 3

    def same_in_both(response):
        body = comparable(response)
        for item in body["output"]:
            item.pop("call_id", None)  # the engine names each call anew
        body["usage"]["input_tokens_details"]["cached_tokens"] = 0  # the second call hits the prefix cache
        return body

    assert same_in_both(final) == same_in_both(created)


def test_function_call_round_trip_by_previous_response_id_and_by_items(sdk, model):
    first = sdk.responses.create(model=model, input=QUESTION, tools=TOOLS)
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}
    chained = sdk.responses.create(model=model, previous_response_id=first.id, input=[result], tools=TOOLS)
    items = [{"role": "user", "content": QUESTION}] + [item.model_dump(exclude_none=True) for item in first.output]
    listed = sdk.responses.create(model=model, input=items + [result], tools=TOOLS, store=False)
    for response in (chained, listed):
        assert response.output_text == PLAIN and [item.type for item in response.output] == ["message"]
    assert chained.usage.input_tokens == listed.usage.input_tokens > first.usage.input_tokens
    assert sdk.responses.retrieve(chained.id).output_text == PLAIN


def test_text_format_holds_the_answer_to_the_schema(sdk, model):
    class City(BaseModel):
        city: Literal["Paris"]

    response = sdk.responses.parse(model=model, input=QUESTION, reasoning={"effort": "none"}, text_format=City,
                                   max_output_tokens=50)
    assert response.output_parsed == City(city="Paris")
    assert response.text.format.type == "json_schema" and response.text.format.name == "City"


@pytest.mark.parametrize("way", ["run", "run_streamed", "chained"])
def test_an_openai_agents_agent_calls_a_tool_and_answers(url, model, way):
    """Runner.run sends the whole item list each turn, run_streamed reads the event stream, and
    chained (auto_previous_response_id) sends only the tool's result after the stored response."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    async def turn(agent):
        if way != "run_streamed":
            return await agents.Runner.run(agent, QUESTION, max_turns=3, auto_previous_response_id=way == "chained")
        result = agents.Runner.run_streamed(agent, QUESTION, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        agent = agents.Agent(name="weather", instructions="Answer with the tool's help.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model=model, openai_client=client))
        try:
            return await asyncio.wait_for(turn(agent), timeout=120)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls == ["Paris"]
    assert result.final_output == PLAIN
    first, second = [response.response_id for response in result.raw_responses]
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert sdk.responses.retrieve(second).previous_response_id == (first if way == "chained" else None)


def test_an_openai_agents_run_keeps_its_turns_in_a_conversation(url, sdk, model):
    """Runner.run with conversation_id sends each turn's new input with conversation=, and the
    conversation holds every turn."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    conversation = sdk.conversations.create(metadata={"agent": "helper"})

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        agent = agents.Agent(name="helper", instructions="Be brief.",
                             model=agents.OpenAIResponsesModel(model=model, openai_client=client),
                             model_settings=agents.ModelSettings(reasoning=Reasoning(effort="none")))
        try:
            return [await agents.Runner.run(agent, question, conversation_id=conversation.id)
                    for question in ("Hi!", "Again!")]
        finally:
            await client.close()

    first, second = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert first.final_output == second.final_output == PLAIN
    items = list(sdk.conversations.items.list(conversation.id, order="asc"))
    assert [(item.role, item.content[0].text) for item in items] == [
        ("user", "Hi!"), ("assistant", PLAIN), ("user", "Again!"), ("assistant", PLAIN)]
    second_response = sdk.responses.retrieve(second.raw_responses[0].response_id)
    assert second_response.conversation.id == conversation.id and second_response.usage.input_tokens > 10

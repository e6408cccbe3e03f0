"""A tool call through SMG: a scripted engine writes Qwen3's <think> and <tool_call> blocks as
token ids; SMG (reasoning parser qwen3, tool-call parser qwen) turns them into OpenAI's
reasoning_content and tool_calls, streamed and not."""

import json

import pytest
from openai import OpenAI

from tests.scaleout.gateway import Gateway
from tests.server.engine_process import EngineProcess
from tests.support.scripted_model import script_tokens, write_scripted_model
from tests.test_chat_features_e2e import CONTENT, OFFICIAL_TEMPLATE, QUESTION, REASONING, TOOLS
from xserv_engine.tokenizer.chat_tokens import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START
from xserv_engine.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

# Qwen3 writes "<tool_call>\n{...}\n</tool_call>" (SMG's qwen parser wants the newlines); "\n"
# itself ends the prompt (the script's trigger), so the call opens with "\n\n", another token.
# Pieces are tokenized apart so that no token repeats.
CALL_PIECES = ("\n\n", '{"name":"get_weather","arguments":{"city":', '"Paris"}}\n')


@pytest.fixture(scope="module")
def sdk(tmp_path_factory, demo_dir):
    tokenizer = Tokenizer.from_dir(demo_dir)
    script = script_tokens(tokenizer, "\n", THINK_START, REASONING, THINK_END, CONTENT,
                           TOOL_CALL_START, *CALL_PIECES, TOOL_CALL_END)
    model = tmp_path_factory.mktemp("scripted")
    template = OFFICIAL_TEMPLATE.read_text() if OFFICIAL_TEMPLATE.is_file() else None
    write_scripted_model(model, demo_dir, [script], chat_template=template)
    logs = tmp_path_factory.mktemp("tools")
    engine = EngineProcess("--model", str(model), "--served-model-name", "scripted", "--dtype", "float32",
                           log_path=logs / "engine.log")
    gateway = None
    try:
        engine.wait_serving()
        gateway = Gateway([engine.address], log_path=logs / "smg.log")
        gateway.wait_ready("scripted", workers=1)
        yield OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


def test_a_tool_call_comes_back_as_openai_tool_calls(sdk):
    answer = sdk.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS, max_tokens=100)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.reasoning_content.strip() == REASONING
    assert choice.message.content.strip() == CONTENT
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call_assembles_to_the_same_call(sdk):
    chunks = list(sdk.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS, max_tokens=100,
                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

"""Chat features on the Qwen3.5 demo (random weights), whose <think>, </think>, <tool_call> and
<|im_start|> ids are not Qwen3's: the engine finds them in the model's own tokenizer, so the
reasoning lands in reasoning_text, a constraint starts after </think> and forced tool calls come
back parsed. The answers are random text: the tests check their structure."""

import json

import jsonschema
import pytest

from tests.engine.conftest import generate, make_engine
from tests.structured.test_engine import assert_all_freed, forced_calls
from tests.tokenizer.test_chat_tokens import QWEN3_5_TOKENS
from xserv_engine.inputs import ChatInput
from xserv_engine.structured.constraint import JSON_SCHEMA, Constraint
from xserv_engine.tokenizer.tool_call_parsers import XML_PARSER

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a"], "additionalProperties": False}
CONSTRAINT = Constraint(JSON_SCHEMA, json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine(demo_qwen3_5_dir):
    # the served dtype: these tests check structure, and the fp32 head over 248,320 tokens is the
    # module's slowest part
    engine = make_engine(demo_qwen3_5_dir, max_model_len=1024, dtype="auto")
    yield engine
    engine.shutdown()


def chat(**template_kwargs) -> ChatInput:
    return ChatInput([{"role": "user", "content": "Hi"}], template_kwargs=template_kwargs)


def test_the_engine_reads_qwen3_5_s_tokens_and_tool_call_format(engine):
    assert engine.engine.tokenizer.chat_tokens == QWEN3_5_TOKENS
    assert engine.engine.tool_call_parser == XML_PARSER  # from the chat template


def test_thinking_on_the_answer_is_reasoning_and_off_it_is_content(engine):
    thinking = generate(engine, chat(), max_tokens=12, temperature=0.0)  # the prompt ends in "<think>\n"
    assert thinking.text() == "" and thinking.final().finish_reason == "length"
    reasoning = "".join(o.reasoning_text for o in thinking.outputs)
    assert reasoning.strip() and thinking.final().usage.reasoning_tokens == 12
    plain = generate(engine, chat(enable_thinking=False), max_tokens=12, temperature=0.0)
    assert plain.text().strip() and "".join(o.reasoning_text for o in plain.outputs) == ""
    assert plain.final().usage.reasoning_tokens == 0


def test_thinking_off_a_json_schema_answer_parses(engine):
    for seed in range(4):
        collector = generate(engine, chat(enable_thinking=False), max_tokens=16, temperature=1.0, seed=seed,
                             constraint=CONSTRAINT)
        assert collector.final().finish_reason == "stop"
        jsonschema.validate(json.loads(collector.text()), SCHEMA)
    assert_all_freed(engine)


def test_thinking_on_the_constraint_starts_after_think_end(engine):
    # the bias stands in for a trained model's wish to stop thinking: </think> is free to come
    # first, then the grammar holds the answer (and masks </think> away)
    end = QWEN3_5_TOKENS.think_end
    collector = generate(engine, chat(), max_tokens=16, temperature=1.0, logit_bias={end: 40.0},
                         constraint=CONSTRAINT)
    assert collector.token_ids()[0] == end and collector.final().finish_reason == "stop"
    jsonschema.validate(json.loads(collector.text()), SCHEMA)


def test_forced_tool_calls_come_back_as_parsed_qwen3_coder_calls(engine):
    assert all(forced_calls(engine, 4, "required"))
    for calls in forced_calls(engine, 4, "get_weather", parallel_tool_calls=False):
        assert [name for name, _ in calls] == ["get_weather"]
    assert_all_freed(engine)

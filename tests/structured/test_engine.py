"""Constrained generation in the in-process engine, at temperature 1 on the random demo model:
every answer that ends is valid, under concurrency, n=2, preemption, aborts, stops and max_tokens,
and every KV block and matcher is freed afterwards."""

import json
import re
import time

import jsonschema
import pytest

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from tests.structured.schemas import PARAMETERS, PERSON, PERSON_JSON, TOOLS
from tests.tokenizer.test_chat_tokens import QWEN3_TOKENS
from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.constraint import CHOICE, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint

PROMPT = "Describe a person as JSON:"
PERSON_CONSTRAINT = Constraint(JSON_SCHEMA, PERSON_JSON)
THINK, END_THINK = QWEN3_TOKENS.think_start, QWEN3_TOKENS.think_end


def run_concurrently(engine, count: int, prompt=PROMPT, **params) -> list[Collector]:
    """`count` requests at once; with a seed, request i samples with seed + i."""
    collectors = [Collector(params.get("n", 1)) for _ in range(count)]
    for i, collector in enumerate(collectors):
        seeded = {"seed": params["seed"] + i} if "seed" in params else {}
        engine.add_request(f"concurrent-{id(collectors)}-{i}", prompt, SamplingParams(**{**params, **seeded}), collector)
    for collector in collectors:
        collector.wait(timeout=300)
    return collectors


def assert_all_freed(engine) -> None:
    wait_idle(engine)
    assert engine.structured.num_active == 0


def test_32_concurrent_schema_answers_all_validate(engine):
    collectors = run_concurrently(engine, 32, max_tokens=200, temperature=1.0, constraint=PERSON_CONSTRAINT)
    answers = [json.loads(c.text()) for c in collectors]
    for collector, answer in zip(collectors, answers):
        assert collector.final().finish_reason == "stop"
        jsonschema.validate(answer, PERSON)
    assert len({json.dumps(a) for a in answers}) > 16  # sampled, not one forced answer
    assert_all_freed(engine)


def test_regex_and_choice_answers_match(engine):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    regex = run_concurrently(engine, 16, max_tokens=40, temperature=1.0, constraint=Constraint(REGEX, pattern))
    assert all(re.fullmatch(pattern, c.text()) and c.final().finish_reason == "stop" for c in regex)
    options = ("yes", "no", "maybe not")
    choice = run_concurrently(engine, 16, max_tokens=40, temperature=1.0, constraint=Constraint(CHOICE, options))
    assert all(c.text() in options and c.final().finish_reason == "stop" for c in choice)
    assert_all_freed(engine)


def test_json_object_answers_parse_and_cut_ones_end_with_length(engine):
    # JSON mode bounds nothing: on a random model a string can run past max_tokens. Seeded: an
    # unseeded run now and then had no answer end within 64 tokens.
    collectors = run_concurrently(engine, 16, max_tokens=64, temperature=1.0, constraint=Constraint(JSON_OBJECT),
                                  seed=100)
    finished = [c for c in collectors if c.final().finish_reason == "stop"]
    assert finished
    for collector in finished:
        assert isinstance(json.loads(collector.text()), dict)
    for collector in collectors:
        if collector.final().finish_reason != "stop":
            assert collector.final().finish_reason == "length" and len(collector.token_ids()) == 64
            assert collector.text().startswith("{")
    assert_all_freed(engine)


def test_n2_gives_two_valid_answers(engine):
    collector = generate(engine, PROMPT, n=2, max_tokens=200, temperature=1.0, constraint=PERSON_CONSTRAINT)
    answers = [json.loads(collector.text(i)) for i in (0, 1)]
    for answer in answers:
        jsonschema.validate(answer, PERSON)
    assert answers[0] != answers[1]
    assert_all_freed(engine)


def test_a_complete_answer_ends_the_choice_even_if_the_model_would_go_on(engine):
    collector = generate(engine, PROMPT, max_tokens=50, temperature=1.0, ignore_eos=True,
                         constraint=Constraint(CHOICE, ("yes", "no")))
    assert collector.text() in ("yes", "no") and collector.final().finish_reason == "stop"
    assert len(collector.token_ids()) < 50


def test_max_tokens_cuts_with_length_and_stop_strings_still_stop(engine):
    cut = generate(engine, PROMPT, max_tokens=4, temperature=1.0, constraint=PERSON_CONSTRAINT)
    assert cut.final().finish_reason == "length" and cut.text().startswith('{"')
    stopped = generate(engine, PROMPT, max_tokens=40, temperature=1.0, stop=[" STOP"],
                       constraint=Constraint(REGEX, "[a-z]{3} STOP [a-z]{3}"))
    assert stopped.final().finish_reason == "stop" and re.fullmatch("[a-z]{3}", stopped.text())
    assert_all_freed(engine)


def test_greedy_rows_are_masked_too(engine):
    collector = generate(engine, PROMPT, max_tokens=200, temperature=0.0, constraint=PERSON_CONSTRAINT)
    jsonschema.validate(json.loads(collector.text()), PERSON)


def test_aborts_mid_stream_free_their_matchers_and_blocks(engine):
    collectors = [Collector() for _ in range(8)]
    for i, collector in enumerate(collectors):
        engine.add_request(f"abort-{i}", PROMPT, SamplingParams(max_tokens=200, temperature=1.0,
                                                                  constraint=PERSON_CONSTRAINT), collector)
    deadline = time.monotonic() + 120
    while len(collectors[0].outputs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(0, 8, 2):
        engine.abort(f"abort-{i}")
    for i, collector in enumerate(collectors):
        collector.wait(timeout=300)
        if i % 2 == 0:
            assert collector.final().finish_reason == "abort"
        else:
            jsonschema.validate(json.loads(collector.text()), PERSON)
    assert_all_freed(engine)


def test_preemption_by_recompute_keeps_every_answer_valid(demo_dir):
    engine = make_engine(demo_dir, max_model_len=256, num_kv_blocks=20)  # 320 tokens for 8 x ~70
    try:
        collectors = run_concurrently(engine, 8, max_tokens=150, temperature=1.0, constraint=PERSON_CONSTRAINT)
        assert engine.stats().preemptions > 0
        for collector in collectors:
            assert collector.final().finish_reason == "stop"
            jsonschema.validate(json.loads(collector.text()), PERSON)
        assert_all_freed(engine)
    finally:
        engine.shutdown()


def chat(**kwargs) -> ChatInput:
    thinking = kwargs.pop("enable_thinking", False)
    return ChatInput([{"role": "user", "content": "What is the weather in Oslo?"}],
                     template_kwargs={"enable_thinking": thinking}, **kwargs)


def test_thinking_off_constrains_from_the_first_token(engine):
    collector = generate(engine, chat(), max_tokens=200, temperature=1.0, constraint=PERSON_CONSTRAINT)
    jsonschema.validate(json.loads(collector.text()), PERSON)


def test_thinking_on_leaves_the_think_block_free_then_constrains(engine):
    # the biases stand in for a trained model's wish to think and then to stop thinking
    collector = generate(engine, chat(enable_thinking=True), max_tokens=200, temperature=1.0,
                         logit_bias={THINK: 30.0, END_THINK: 31.0}, constraint=PERSON_CONSTRAINT)
    # <think> and </think> are both likely first tokens: neither is JSON, so whatever comes
    # before the first </think> shows the reasoning is free; the JSON starts right after it
    token_ids = collector.token_ids()
    end = token_ids.index(END_THINK)
    assert set(token_ids[:end]) <= {THINK}
    jsonschema.validate(json.loads(collector.text()), PERSON)


def tool_calls(collector) -> list[tuple[str, dict]]:
    deltas = [d for o in collector.outputs for d in o.tool_calls]
    calls: dict[int, list] = {}
    for delta in deltas:
        calls.setdefault(delta.index, ["", ""])
        calls[delta.index][0] += delta.name
        calls[delta.index][1] += delta.arguments
    return [(name, json.loads(arguments)) for name, arguments in calls.values()]


def forced_calls(engine, count: int, tool_choice: str, **chat_options) -> list[list[tuple[str, dict]]]:
    """The calls of `count` concurrent answers forced by tool_choice, each checked: it ends with
    tool_calls, has no text, and every call's arguments are valid against its tool's schema."""
    collectors = run_concurrently(engine, count, chat(tools=TOOLS, tool_choice=tool_choice, **chat_options),
                                  max_tokens=300, temperature=1.0)
    answers = []
    for collector in collectors:
        assert collector.final().finish_reason == "tool_calls" and collector.text() == ""
        answers.append(tool_calls(collector))
        for name, arguments in answers[-1]:
            jsonschema.validate(arguments, PARAMETERS[name])
    return answers


def test_required_tool_choice_always_gives_valid_calls(engine):
    assert all(forced_calls(engine, 8, "required"))
    assert_all_freed(engine)


def test_a_named_tool_without_parallel_calls_gives_exactly_that_one_call(engine):
    for calls in forced_calls(engine, 8, "get_weather", parallel_tool_calls=False):
        assert [name for name, _ in calls] == ["get_weather"]


@pytest.mark.parametrize("prompt, params, field", [
    (PROMPT, {"constraint": Constraint(JSON_SCHEMA, '{"type": "array", "uniqueItems": true}')}, "json_schema"),
    (PROMPT, {"constraint": Constraint(REGEX, "(")}, "regex"),
    (chat(tools=TOOLS, tool_choice="get_news"), {}, "chat.tool_choice"),
    (chat(tools=TOOLS, tool_choice="required"), {"constraint": PERSON_CONSTRAINT}, "chat.tool_choice"),
])
def test_a_constraint_that_cannot_be_served_fails_before_anything_is_queued(engine, prompt, params, field):
    before = engine.stats()
    with pytest.raises(InvalidRequest) as error:
        engine.add_request("rejected", prompt, SamplingParams(max_tokens=10, **params), Collector())
    assert error.value.field == field
    assert engine.stats().waiting == before.waiting and engine.structured.num_active == 0

"""OutputParser on token streams: however the detokenizer cuts the text, the answer is the same.

A generation is written as items: an int is a tag token (its piece is the tag's text), a str is
ordinary text that the tests cut into pieces every way that matters (no cut, each single cut,
each pair of cuts, char by char with empty pieces between, random cuts).
"""

import itertools
import json
import random

import pytest

from tests.tokenizer.test_chat_tokens import QWEN3_TOKENS
from xserv_engine.outputs import ToolCallDelta
from xserv_engine.tokenizer.chat_tokens import ChatTokens
from xserv_engine.tokenizer.parsers import OutputParser, new_tool_call_id, prompt_opens_reasoning

THINK, END_THINK = QWEN3_TOKENS.think_start, QWEN3_TOKENS.think_end
CALL, END_CALL = QWEN3_TOKENS.tool_call_start, QWEN3_TOKENS.tool_call_end
TAG_TEXT = {THINK: "<think>", END_THINK: "</think>", CALL: "<tool_call>", END_CALL: "</tool_call>"}
TEXT_ID = 1000  # any ordinary token

WEATHER = '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
WEATHER_ARGS = '{"city": "Paris", "unit": "C"}'
TIME = '\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
TIME_ARGS = '{"tz": "Europe/Paris"}'


def token_stream(items, cuts=(), gaps=False):
    """(token_id, piece) pairs; `cuts` are positions in the concatenation of the text items.
    With `gaps`, an empty piece follows each text piece, as for a held-back multi-byte char."""
    stream, offset = [], 0
    for item in items:
        if isinstance(item, int):
            stream.append((item, TAG_TEXT[item]))
            continue
        inside = sorted(c - offset for c in cuts if offset < c < offset + len(item))
        bounds = [0, *inside, len(item)]
        for start, stop in zip(bounds, bounds[1:]):
            stream.append((TEXT_ID, item[start:stop]))
            if gaps:
                stream.append((TEXT_ID, ""))
        offset += len(item)
    return stream


def every_stream(items):
    length = sum(len(item) for item in items if isinstance(item, str))
    points = range(1, length)
    yield token_stream(items)
    yield token_stream(items, points, gaps=True)
    for point in points:
        yield token_stream(items, [point])
    if length <= 40:
        for pair in itertools.combinations(points, 2):
            yield token_stream(items, pair)
    rng = random.Random(0)
    for _ in range(50):
        cuts = [point for point in points if rng.random() < 0.3]
        yield token_stream(items, cuts, gaps=rng.random() < 0.5)


def sequential_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(stream, **options):
    """(content, reasoning, [(id, name, arguments)]) as a client accumulates the deltas."""
    options.setdefault("starts_in_reasoning", False)
    options.setdefault("new_call_id", sequential_ids())
    parser = OutputParser(options.pop("tokens", QWEN3_TOKENS), **options)
    deltas = [parser.feed(token_id, piece) for token_id, piece in stream] + [parser.finish()]
    calls = {}
    for call in (call for delta in deltas for call in delta.tool_calls):
        id_, name, arguments = calls.get(call.index, ("", "", ""))
        calls[call.index] = (id_ + call.id, name + call.name, arguments + call.arguments)
    content = "".join(delta.content for delta in deltas)
    reasoning = "".join(delta.reasoning for delta in deltas)
    return content, reasoning, [calls[index] for index in sorted(calls)]


def parse_every_way(items, **options):
    answers = {repr(stream): run(stream, **options) for stream in every_stream(items)}
    first = next(iter(answers.values()))
    for stream, answer in answers.items():
        assert answer == first, stream
    return first


def test_reasoning_then_content():
    items = [THINK, "\nLet me add.\n2+2=4.\n", END_THINK, "\n\nThe answer is 4."]
    assert parse_every_way(items) == ("The answer is 4.", "Let me add.\n2+2=4.", [])


def test_prompt_opened_reasoning():
    items = ["\nHmm, 2+2.\n", END_THINK, "\n\n4"]
    assert parse_every_way(items, starts_in_reasoning=True) == ("4", "Hmm, 2+2.", [])


def test_reasoning_never_closed_is_all_reasoning():
    assert parse_every_way([THINK, "\nstill thinking\n\n"]) == ("", "still thinking\n\n", [])
    answer = parse_every_way(["no end in sight"], starts_in_reasoning=True)
    assert answer == ("", "no end in sight", [])


def test_no_reasoning_keeps_content_verbatim():
    items = ["  Hello,\n\nworld! 你好 🌍\n"]
    assert parse_every_way(items) == ("  Hello,\n\nworld! 你好 🌍\n", "", [])
    assert parse_every_way(items, parse_tools=False) == ("  Hello,\n\nworld! 你好 🌍\n", "", [])


def test_empty_think_block_from_the_template():
    items = ["<think>\n\n</think>\n\n", "Hi"]  # enable_thinking=False: in the prompt, not generated
    assert run(token_stream([THINK, "\n\n", END_THINK, "\n\nHi"])) == ("Hi", "", [])
    assert run(token_stream(items), parse_reasoning=False)[0] == "<think>\n\n</think>\n\nHi"


def test_think_block_then_tool_call():
    items = [THINK, "\nI need the weather.\n", END_THINK, "\n\n", CALL, WEATHER, END_CALL]
    answer = parse_every_way(items)
    assert answer == ("", "I need the weather.", [("call_0", "get_weather", WEATHER_ARGS)])


def test_several_tool_calls_with_text_around():
    items = ["Checking both.\n\n", CALL, WEATHER, END_CALL, "\n", CALL, TIME, END_CALL, "\n\nDone."]
    content, reasoning, calls = parse_every_way(items)
    assert content == "Checking both.Done."
    assert calls == [("call_0", "get_weather", WEATHER_ARGS), ("call_1", "get_time", TIME_ARGS)]


def test_tool_call_deltas_have_openai_streaming_shape():
    parser = OutputParser(QWEN3_TOKENS, starts_in_reasoning=False, new_call_id=sequential_ids())
    deltas = [parser.feed(token_id, piece) for token_id, piece in token_stream([CALL, WEATHER])]
    assert all(not delta.tool_calls for delta in deltas)
    assert not parser.has_tool_calls
    closing = parser.feed(END_CALL, "</tool_call>")
    assert closing.tool_calls == [
        ToolCallDelta(index=0, id="call_0", name="get_weather", arguments=""),
        ToolCallDelta(index=0, arguments=WEATHER_ARGS),
    ]
    assert parser.has_tool_calls
    assert closing.content == "" and closing.reasoning == ""


@pytest.mark.parametrize(
    "body",
    [
        '\n{"name": "get_weather", "arguments": {"city": "Paris"}\n',  # unbalanced
        '\n{"arguments": {"city": "Paris"}}\n',  # no name
        '\n{"name": "", "arguments": {}}\n',
        '\n{"name": "f", "arguments": [1, 2]}\n',
        '\n["get_weather"]\n',
        "\n" + "[" * 100_000 + "\n",  # deeper than json can recurse
    ],
)
def test_malformed_tool_call_is_content_verbatim(body):
    items = ["Sure.\n", CALL, body, END_CALL, "\nbye"]
    answer = run(token_stream(items))
    assert answer == ("Sure.\n<tool_call>" + body + "</tool_call>\nbye", "", [])
    if len(body) < 100:
        assert parse_every_way(items) == answer


def test_unterminated_tool_call_is_content_at_finish():
    items = ["x ", CALL, '\n{"name": "get_weather", "argu']
    assert parse_every_way(items) == ('x <tool_call>\n{"name": "get_weather", "argu', "", [])


def test_new_tool_call_before_the_last_one_closed():
    items = [CALL, '{"name": "a"', CALL, WEATHER, END_CALL]
    content, _, calls = parse_every_way(items)
    assert content == '<tool_call>{"name": "a"'
    assert calls == [("call_0", "get_weather", WEATHER_ARGS)]


def test_tool_call_inside_unclosed_reasoning_ends_it():
    items = [THINK, "\nCall the tool.\n", CALL, WEATHER, END_CALL]
    answer = parse_every_way(items)
    assert answer == ("", "Call the tool.", [("call_0", "get_weather", WEATHER_ARGS)])


def test_arguments_given_as_a_string_pass_through():
    body = '{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert parse_every_way([CALL, body, END_CALL])[2] == [("call_0", "f", '{"a": 1}')]


def test_missing_arguments_mean_no_arguments():
    assert parse_every_way([CALL, '{"name": "now"}', END_CALL])[2] == [("call_0", "now", "{}")]


def test_non_ascii_arguments_stay_intact():
    body = '\n{"name": "search", "arguments": {"q": "北京天气 ☀️😀", "n": 3}}\n'
    calls = parse_every_way([CALL, body, END_CALL])[2]
    assert calls == [("call_0", "search", '{"q": "北京天气 ☀️😀", "n": 3}')]


def test_streamed_arguments_join_to_the_one_shot_json():
    body = '{"name": "f", "arguments": {"nested": {"list": [1, 2.5, null, true]}, "s": "a\\"b"}}'
    one_shot = json.dumps(json.loads(body)["arguments"], ensure_ascii=False)
    (_, _, arguments), = parse_every_way([CALL, body, END_CALL])[2]
    assert arguments == one_shot
    assert json.loads(arguments) == json.loads(body)["arguments"]


def test_default_call_ids_are_unique_and_prefixed():
    items = [CALL, WEATHER, END_CALL, CALL, TIME, END_CALL]
    answers = [run(token_stream(items), new_call_id=new_tool_call_id) for _ in range(3)]
    call_ids = [call[0] for _, _, calls in answers for call in calls]
    assert len(call_ids) == 6 == len(set(call_ids))
    assert all(id_.startswith("call_") and len(id_) == 29 and id_[5:].isalnum() for id_ in call_ids)


def test_has_tool_calls_only_after_a_call_parses():
    parser = OutputParser(QWEN3_TOKENS, starts_in_reasoning=False)
    for token_id, piece in token_stream(["text ", CALL, "{bad}", END_CALL]):
        parser.feed(token_id, piece)
    assert not parser.has_tool_calls
    for token_id, piece in token_stream([CALL, WEATHER, END_CALL]):
        parser.feed(token_id, piece)
    assert parser.has_tool_calls


def test_tags_are_plain_text_when_parsing_is_off():
    items = [THINK, "\nhmm\n", END_THINK, "\n\n", CALL, WEATHER, END_CALL]
    plain = "<think>\nhmm\n</think>\n\n<tool_call>" + WEATHER + "</tool_call>"
    answer = parse_every_way(items, parse_reasoning=False, parse_tools=False)
    assert answer == (plain, "", [])
    tool_text = "<tool_call>" + WEATHER + "</tool_call>"
    assert parse_every_way(items, parse_tools=False) == (tool_text, "hmm", [])
    content, reasoning, calls = parse_every_way(items, parse_reasoning=False)
    assert (content, reasoning) == ("<think>\nhmm\n</think>", "")
    assert calls == [("call_0", "get_weather", WEATHER_ARGS)]


def test_held_back_text_on_a_tag_piece_stays_in_its_section():
    stream = [(THINK, "<think>"), (TEXT_ID, "caf"), (TEXT_ID, ""), (END_THINK, "é</think>")]
    stream.append((TEXT_ID, "ok"))
    assert run(stream) == ("ok", "café", [])


def test_stray_closing_tags_never_reach_content():
    items = ["a", END_CALL, "b", END_THINK, "\n\nc"]
    assert parse_every_way(items) == ("abc", "", [])


@pytest.mark.parametrize(
    ("prompt_ids", "opens"),
    [
        ([], False),
        ([1, 2, 3], False),
        ([1, THINK], True),
        ([1, THINK, 198], True),
        ([THINK, 198, END_THINK, 271], False),
        ([THINK, 5, END_THINK, 7, THINK, 198], True),
        ([END_THINK], False),
    ],
)
def test_prompt_opens_reasoning(prompt_ids, opens):
    assert prompt_opens_reasoning(prompt_ids, QWEN3_TOKENS) is opens
    assert not prompt_opens_reasoning(prompt_ids, ChatTokens(None, None, CALL, END_CALL, None))


def test_a_vocabulary_without_think_tokens_leaves_every_token_to_the_content():
    """Another vocabulary's ids: Qwen3's <think> id is ordinary text there, and no tag of its own
    is a think tag."""
    no_think = ChatTokens(None, None, CALL, END_CALL, None)
    items = [THINK, "\nhmm\n", END_THINK, "\n\n", CALL, WEATHER, END_CALL]
    content, reasoning, calls = parse_every_way(items, tokens=no_think)
    assert (content, reasoning) == ("<think>\nhmm\n</think>", "")
    assert calls == [("call_0", "get_weather", WEATHER_ARGS)]


@pytest.mark.parametrize("starts_in_reasoning, pieces", [
    (False, [THINK, "\nWeigh it.\n", END_THINK, "\n\nDone."]),  # <think> through </think>
    (True, ["Weigh it.\n", END_THINK, "\n\nDone."]),  # the prompt opened it: through </think>
    (True, ["Weigh it and never stop"]),  # all of it
    (False, ["Just the answer."]),  # none
])
def test_usage_counts_the_reasoning_tokens(tokenizer, starts_in_reasoning, pieces):
    from xserv_engine.engine.output_stream import OutputStream
    from xserv_engine.sampling_params import SamplingParams

    ids = [piece for p in pieces for piece in ([p] if isinstance(p, int) else tokenizer.encode(p))]
    upto = ids.index(END_THINK) + 1 if END_THINK in ids else len(ids) if starts_in_reasoning else 0
    stream = OutputStream(tokenizer, SamplingParams(), starts_in_reasoning=starts_in_reasoning,
                          parse_reasoning=True, parse_tools=True)
    for token_id in ids:
        stream.add_token(token_id, None)
    stream.finish()
    assert stream.reasoning_tokens == upto
    off = OutputStream(tokenizer, SamplingParams(), starts_in_reasoning=starts_in_reasoning,
                       parse_reasoning=False, parse_tools=True)
    for token_id in ids:
        off.add_token(token_id, None)
    assert off.reasoning_tokens == 0  # reasoning not split out: all of it is content

"""coalesce(): what a consumer that fell behind the engine gets instead of one output per step."""

from xserv_engine.outputs import RequestOutput, TokenLogprob, ToolCallDelta, Usage, coalesce


def test_consecutive_outputs_of_a_choice_join_into_one_with_the_same_content():
    prompt = (TokenLogprob(7, "A", b"A", None), TokenLogprob(8, "B", b"B", -1.0))
    outs = [RequestOutput("r", 0, (1,), "a", reasoning_text="x", prompt_logprobs=prompt),
            RequestOutput("r", 0, (2,), "b"),
            RequestOutput("r", 0, (3,), "c", finish_reason="stop", matched_stop="END", usage=Usage(4, 3, 0))]
    [one] = coalesce(outs)
    assert (one.token_ids, one.text, one.reasoning_text) == ((1, 2, 3), "abc", "x")
    assert (one.finish_reason, one.matched_stop, one.usage) == ("stop", "END", Usage(4, 3, 0))
    assert one.prompt_logprobs == prompt


def test_choices_stay_apart_in_order_of_first_appearance():
    outs = [RequestOutput("r", 0, (1,), "a"), RequestOutput("r", 1, (9,), "x"),
            RequestOutput("r", 0, (2,), "b", finish_reason="length"), RequestOutput("r", 1, (8,), "y")]
    assert [(o.index, o.text, o.finished) for o in coalesce(outs)] == [(0, "ab", True), (1, "xy", False)]


def test_nothing_joins_onto_a_finished_or_failed_output():
    done = RequestOutput("r", 0, (1,), "a", finish_reason="length")
    failed = RequestOutput("r", 1, error="boom")
    later = [RequestOutput("r", 0, (2,), "b"), RequestOutput("r", 1, (3,), "c")]
    assert coalesce([done, failed, *later]) == [done, failed, *later]


def test_tool_call_fragments_join_per_call_and_a_calls_first_delta_keeps_its_empty_arguments():
    # the parser gives a call's header (id, name, arguments "") and its arguments in one output; a
    # consumer that fell behind must still see the header alone first, as OpenAI streams a call
    outs = [RequestOutput("r", 0, (1,), "a"),
            RequestOutput("r", 0, tool_calls=(ToolCallDelta(0, "call_1", "f"), ToolCallDelta(0, arguments='{"a"'))),
            RequestOutput("r", 0, tool_calls=(ToolCallDelta(0, arguments=": 1}"),)),
            RequestOutput("r", 0, tool_calls=(ToolCallDelta(1, "call_2", "g"), ToolCallDelta(1, arguments="{}")))]
    [one] = coalesce(outs)
    assert one.tool_calls == (ToolCallDelta(0, "call_1", "f"), ToolCallDelta(0, arguments='{"a": 1}'),
                              ToolCallDelta(1, "call_2", "g"), ToolCallDelta(1, arguments="{}"))

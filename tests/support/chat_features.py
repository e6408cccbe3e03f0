"""What a served model, whatever its architecture, must do above the model through the OpenAI SDK:
a json_schema answer per choice of n > 1, and a forced tool call, both with thinking off."""

import json

# an enum and no other properties: a random model finishes the call in a few tokens
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]
# a boolean: a random model's integer may not end within max_tokens
SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
          "additionalProperties": False}


def assert_structured_output_forced_tool_call_and_n(sdk) -> None:
    model = sdk.models.list().data[0].id
    question = [{"role": "user", "content": "Weather in Paris?"}]
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = sdk.chat.completions.create(
        model=model, messages=question, max_tokens=40, n=2, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body=no_thinking)
    assert len(answer.choices) == 2
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content  # the grammar closed the object
        assert isinstance(json.loads(choice.message.content)["answer"], bool)
    forced = sdk.chat.completions.create(
        model=model, messages=question, max_tokens=60, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        extra_body=no_thinking)
    assert forced.choices[0].finish_reason == "tool_calls", forced.choices[0]
    call = forced.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")

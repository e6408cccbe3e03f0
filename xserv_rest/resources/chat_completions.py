"""POST /v1/chat/completions: OpenAI chat completions, streamed (chat.completion.chunk) or not."""

from typing import Iterator

from xserv.v1 import engine_pb2
from xserv_rest.fields import Fields
from xserv_rest.generation import Generation
from xserv_rest.openapi import chat_request
from xserv_rest.render import Choice, UsageCounter, chat_logprobs, finish_reason
from xserv_rest.resources.generation_resource import GenerationResource
from xserv_rest.schemas import GenerationRequest, parse_chat


class ChatCompletions(GenerationResource):
    request_schema = staticmethod(chat_request)
    id_prefix = "chatcmpl"

    def parse(self, body: Fields, request_id: str) -> GenerationRequest:
        """Without max_tokens a chat runs to the end of the context (as in OpenAI and vLLM):
        max_tokens stays unset, which the engine reads that way."""
        return parse_chat(body, request_id)

    def chunks(self, generation: Generation, request: GenerationRequest, head: dict) -> Iterator[dict]:
        head = dict(head, object="chat.completion.chunk")
        # As OpenAI: with include_usage every chunk carries "usage", null until the last one.
        no_usage = {"usage": None} if request.include_usage else {}

        def chunk(index: int, delta: dict, logprobs=None, reason: str | None = None) -> dict:
            return dict(head, choices=[{"index": index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": reason}], **no_usage)

        usage = UsageCounter()
        for index in range(request.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        for message in generation:
            delta = _delta(message)
            logprobs = chat_logprobs(message.logprobs) if request.logprobs and message.logprobs else None
            if delta or logprobs:
                yield chunk(message.index, delta or {"content": ""}, logprobs)
            if finish_reason(message):
                yield chunk(message.index, {}, reason=finish_reason(message))
            usage.add(message)
        if request.include_usage:
            yield dict(head, choices=[], usage=usage.body())

    def answer(self, choices: list[Choice], usage: UsageCounter, request: GenerationRequest, head: dict) -> dict:
        return dict(head, object="chat.completion", choices=[
            {"index": choice.index, "message": _message(choice),
             "logprobs": chat_logprobs(choice.logprobs) if request.logprobs else None,
             "finish_reason": choice.finish_reason}
            for choice in choices], usage=usage.body())


def _delta(message: engine_pb2.GenerateResponse) -> dict:
    delta = {}
    if message.reasoning_text:
        delta["reasoning_content"] = delta["reasoning"] = message.reasoning_text
    if message.text:
        delta["content"] = message.text
    if message.tool_calls:
        delta["tool_calls"] = [_tool_call_delta(call) for call in message.tool_calls]
    return delta


def _tool_call_delta(call: engine_pb2.ToolCallDelta) -> dict:
    if call.id or call.name:
        return {"index": call.index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, "function": {"arguments": call.arguments}}


def _message(choice: Choice) -> dict:
    content = "".join(choice.text)
    message = {"role": "assistant", "content": content if content or not choice.tool_calls else None,
               "refusal": None}
    reasoning = "".join(choice.reasoning)
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": "".join(call["arguments"])}}
            for _, call in sorted(choice.tool_calls.items())]
    return message

"""POST /v1/chat/completions: OpenAI chat completions, streamed (chat.completion.chunk) or not."""

from typing import Iterator

from xserv.v1 import engine_pb2
from xserv_rest.protocol.chat import ChatCompletion, ChatCompletionRequest
from xserv_rest.render import Choice, UsageCounter, chat_logprobs
from xserv_rest.resources.generation_resource import ChunkShape, GenerationResource


class ChatCompletions(GenerationResource):
    id_prefix = "chatcmpl"
    object = "chat.completion.chunk"
    request_model = ChatCompletionRequest

    def chunk_shape(self, request: ChatCompletionRequest) -> ChunkShape:
        return ChatChunks(request.choices, bool(request.logprobs))

    def answer(self, choices: list[Choice], usage: UsageCounter, request: ChatCompletionRequest,
               head: dict) -> ChatCompletion:
        return ChatCompletion(**head, choices=[
            {"index": choice.index, "message": _message(choice),
             "logprobs": chat_logprobs(choice.logprobs) if request.logprobs else None,
             "finish_reason": choice.finish_reason}
            for choice in choices], usage=usage.body())


class ChatChunks(ChunkShape):
    def __init__(self, n: int, logprobs: bool):
        self.n = n
        self.logprobs = logprobs

    def opening(self) -> Iterator[tuple[int, dict]]:
        for index in range(self.n):
            yield index, {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def content(self, message: engine_pb2.GenerateResponse) -> dict | None:
        delta = _delta(message)
        logprobs = chat_logprobs(message.logprobs) if self.logprobs and message.logprobs else None
        if not delta and logprobs is None:
            return None
        return {"delta": delta or {"content": ""}, "logprobs": logprobs, "finish_reason": None}

    def finish(self, reason: str) -> dict:
        return {"delta": {}, "logprobs": None, "finish_reason": reason}


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

"""POST /v1/completions: OpenAI (legacy) text completions, streamed or not."""

from xserv.v1 import engine_pb2
from xserv_rest.protocol.completions import Completion, CompletionRequest
from xserv_rest.render import Choice, UsageCounter, completion_logprobs
from xserv_rest.resources.generation_resource import ChunkShape, GenerationResource


class Completions(GenerationResource):
    id_prefix = "cmpl"
    object = "text_completion"
    request_model = CompletionRequest

    def chunk_shape(self, request: CompletionRequest) -> ChunkShape:
        return CompletionChunks(request.choices, request.logprobs is not None)

    def answer(self, choices: list[Choice], usage: UsageCounter, request: CompletionRequest,
               head: dict) -> Completion:
        return Completion(**head, choices=[
            {"index": choice.index, "text": "".join(choice.text),
             "logprobs": completion_logprobs(choice.logprobs, 0) if request.logprobs is not None else None,
             "finish_reason": choice.finish_reason}
            for choice in choices], usage=usage.body())


class CompletionChunks(ChunkShape):
    def __init__(self, n: int, logprobs: bool):
        self.logprobs = logprobs
        self.text_offsets = [0] * n  # logprobs' text_offset counts from each choice's start

    def content(self, message: engine_pb2.GenerateResponse) -> dict | None:
        logprobs = None
        if self.logprobs and message.logprobs:
            logprobs = completion_logprobs(message.logprobs, self.text_offsets[message.index])
            self.text_offsets[message.index] += sum(len(lp.token) for lp in message.logprobs)
        if not message.text and logprobs is None:
            return None
        return {"text": message.text, "logprobs": logprobs, "finish_reason": None}

    def finish(self, reason: str) -> dict:
        return {"text": "", "logprobs": None, "finish_reason": reason}

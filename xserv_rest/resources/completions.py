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
        return CompletionChunks(request)

    def answer(self, choices: list[Choice], usage: UsageCounter, request: CompletionRequest,
               head: dict) -> Completion:
        return Completion(**head, choices=[
            {"index": choice.index, "text": _echo(request, choice.index, choice.prompt_logprobs) + "".join(choice.text),
             "logprobs": _logprobs(request, choice.prompt_logprobs, choice.logprobs, 0),
             "finish_reason": choice.finish_reason}
            for choice in choices], usage=usage.body())


class CompletionChunks(ChunkShape):
    """With echo, a choice's first chunk starts with the prompt (and its logprobs)."""

    def __init__(self, request: CompletionRequest):
        self.request = request
        self.text_offsets = [0] * request.choices  # logprobs' text_offset counts from each choice's start
        self.echoed = [not request.echo] * request.choices

    def content(self, message: engine_pb2.GenerateResponse) -> dict | None:
        prompt, prompt_logprobs = "", []
        if not self.echoed[message.index]:
            self.echoed[message.index] = True
            prompt = _echo(self.request, message.index, message.prompt_logprobs)
            prompt_logprobs = list(message.prompt_logprobs)
        logprobs = None
        if self.request.logprobs is not None and (prompt_logprobs or message.logprobs):
            logprobs = _logprobs(self.request, prompt_logprobs, message.logprobs, self.text_offsets[message.index])
            self.text_offsets[message.index] += sum(len(token) for token in logprobs["tokens"])
        if not (prompt or message.text or logprobs):
            return None
        return {"text": prompt + message.text, "logprobs": logprobs, "finish_reason": None}

    def finish(self, reason: str) -> dict:
        return {"text": "", "logprobs": None, "finish_reason": reason}


def _echo(request: CompletionRequest, index: int, prompt_logprobs) -> str:
    return request.echoed(index, prompt_logprobs) if request.echo else ""


def _logprobs(request: CompletionRequest, prompt_logprobs, logprobs, text_offset: int) -> dict | None:
    if request.logprobs is None:
        return None
    return completion_logprobs([*(prompt_logprobs if request.echo else ()), *logprobs], text_offset)

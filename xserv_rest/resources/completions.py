"""POST /v1/completions: OpenAI (legacy) text completions, streamed or not."""

from typing import Iterator

from xserv_rest.fields import Fields
from xserv_rest.generation import Generation
from xserv_rest.openapi import completion_request
from xserv_rest.render import Choice, UsageCounter, completion_logprobs, finish_reason
from xserv_rest.resources.generation_resource import GenerationResource
from xserv_rest.schemas import GenerationRequest, parse_completion


DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API


class Completions(GenerationResource):
    request_schema = staticmethod(completion_request)
    id_prefix = "cmpl"

    def parse(self, body: Fields, request_id: str) -> GenerationRequest:
        request = parse_completion(body, request_id)
        params = request.grpc_request.params
        if not params.HasField("max_tokens"):
            params.max_tokens = DEFAULT_MAX_TOKENS
        return request

    def chunks(self, generation: Generation, request: GenerationRequest, head: dict) -> Iterator[dict]:
        head = dict(head, object="text_completion")
        no_usage = {"usage": None} if request.include_usage else {}

        def chunk(index: int, text: str, logprobs=None, reason: str | None = None) -> dict:
            return dict(head, choices=[{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": reason}], **no_usage)

        usage = UsageCounter()
        text_offsets = [0] * request.n
        for message in generation:
            logprobs = None
            if request.logprobs and message.logprobs:
                logprobs = completion_logprobs(message.logprobs, text_offsets[message.index])
                text_offsets[message.index] += sum(len(lp.token) for lp in message.logprobs)
            if message.text or logprobs:
                yield chunk(message.index, message.text, logprobs)
            if finish_reason(message):
                yield chunk(message.index, "", reason=finish_reason(message))
            usage.add(message)
        if request.include_usage:
            yield dict(head, choices=[], usage=usage.body())

    def answer(self, choices: list[Choice], usage: UsageCounter, request: GenerationRequest, head: dict) -> dict:
        return dict(head, object="text_completion", choices=[
            {"index": choice.index, "text": "".join(choice.text),
             "logprobs": completion_logprobs(choice.logprobs, 0) if request.logprobs else None,
             "finish_reason": choice.finish_reason}
            for choice in choices], usage=usage.body())

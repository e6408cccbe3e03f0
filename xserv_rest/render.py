"""Pieces of OpenAI response bodies shared by chat and completions: choices gathered from the
engine's stream, finish reasons, usage and logprobs."""

from dataclasses import dataclass, field
from typing import Iterable

from xserv.v1 import engine_pb2

FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}


def finish_reason(message: engine_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(message.finish_reason)


@dataclass
class Choice:
    """One choice of a non-streaming answer, joined from its messages."""

    index: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, message: engine_pb2.GenerateResponse) -> None:
        self.text.append(message.text)
        self.reasoning.append(message.reasoning_text)
        self.logprobs.extend(message.logprobs)
        self.prompt_logprobs.extend(message.prompt_logprobs)
        for delta in message.tool_calls:
            call = self.tool_calls.setdefault(delta.index, {"id": "", "name": "", "arguments": []})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or delta.name
            call["arguments"].append(delta.arguments)
        self.finish_reason = finish_reason(message) or self.finish_reason


class UsageCounter:
    """Sums the per-choice usage of the engine's last messages into OpenAI's request usage."""

    def __init__(self):
        self.prompts: dict[str, tuple[int, int]] = {}  # engine request id -> (prompt tokens, cached ones)
        self.completion_tokens = 0
        self.reasoning_tokens = 0  # of completion_tokens

    def add(self, message: engine_pb2.GenerateResponse) -> None:
        if message.HasField("usage"):  # each choice of a prompt reports the same prompt
            self.prompts[message.request_id] = (message.usage.prompt_tokens, message.usage.cached_prompt_tokens)
            self.completion_tokens += message.usage.completion_tokens
            self.reasoning_tokens += message.usage.reasoning_tokens

    def merge(self, other: "UsageCounter") -> None:
        """Adds another counter's prompts and tokens (the engine requests of one REST call)."""
        self.prompts.update(other.prompts)
        self.completion_tokens += other.completion_tokens
        self.reasoning_tokens += other.reasoning_tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.prompts.values())

    @property
    def cached_tokens(self) -> int:
        return sum(cached for _, cached in self.prompts.values())

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}


class RunningUsage:
    """Each choice's usage while it streams (stream_options.continuous_usage_stats, as vLLM
    answers it): its prompt's tokens and the tokens the choice has generated so far."""

    def __init__(self):
        self.generated: dict[int, int] = {}  # choice index -> tokens so far

    def add(self, message: engine_pb2.GenerateResponse) -> None:
        self.generated[message.index] = self.generated.get(message.index, 0) + len(message.token_ids)

    def body(self, message: engine_pb2.GenerateResponse, index: int | None = None) -> dict:
        """Usage of choice `index` (by default the message's), whose prompt is the message's."""
        generated = self.generated.get(message.index if index is None else index, 0)
        return {"prompt_tokens": message.prompt_tokens, "completion_tokens": generated,
                "total_tokens": message.prompt_tokens + generated}


def collect(messages: Iterable[engine_pb2.GenerateResponse], n: int) -> tuple[list[Choice], UsageCounter]:
    choices = [Choice(index) for index in range(n)]
    usage = UsageCounter()
    for message in messages:
        if message.index < n:
            choices[message.index].add(message)
        usage.add(message)
    return choices, usage


def chat_logprobs(logprobs: Iterable[engine_pb2.TokenLogprob]) -> dict:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    return {"content": [dict(_candidate(lp), top_logprobs=[_candidate(top) for top in lp.top_logprobs])
                        for lp in logprobs], "refusal": None}


def _candidate(lp) -> dict:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes)}


def completion_logprobs(logprobs: Iterable[engine_pb2.TokenLogprob], text_offset: int) -> dict:
    """Legacy completions shape: parallel lists; text_offset counts from the text's start. A
    prompt's first token (echo) has null for its logprob and alternatives."""
    body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        predicted = lp.HasField("logprob")
        body["tokens"].append(lp.token)
        body["token_logprobs"].append(lp.logprob if predicted else None)
        body["top_logprobs"].append({top.token: top.logprob for top in lp.top_logprobs} if predicted else None)
        body["text_offset"].append(text_offset)
        text_offset += len(lp.token)
    return body

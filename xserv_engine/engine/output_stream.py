"""Per-choice output: tokens -> safe text -> reasoning / content / tool calls -> stop strings.

Order per token: incremental detokenization (never a partial UTF-8 character), the Qwen parser
(switches on the tokenizer's <think>/<tool_call> token ids), then stop strings on the content
text only.
"""

from xserv_engine.layers.sampler import SampleLogprobs
from xserv_engine.outputs import TokenLogprob, ToolCallDelta
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.tokenizer.detokenizer import IncrementalDetokenizer
from xserv_engine.tokenizer.parsers import CallParser, OutputParser
from xserv_engine.tokenizer.stop import StopStringMatcher
from xserv_engine.tokenizer.tokenizer import Tokenizer

NO_TOKEN = -1  # feeds text that belongs to no new token (the detokenizer's flush)


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, *, starts_in_reasoning: bool,
                 parse_reasoning: bool, parse_tools: bool, parse_call: CallParser | None = None):
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.parser = OutputParser(tokenizer.chat_tokens, starts_in_reasoning=starts_in_reasoning,
                                   parse_reasoning=parse_reasoning, parse_tools=parse_tools, parse_call=parse_call)
        self.stop = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.matched_stop: str | None = None
        self.reasoning_tokens = 0  # tokens fed while reasoning, its opening and closing tags included
        self._reset_pending()

    def _reset_pending(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCallDelta] = []
        self.logprobs: list[TokenLogprob] = []

    def add_token(self, token_id: int, logprob: SampleLogprobs | None, show_text: bool = True) -> None:
        """Record a generated token. Sets matched_stop when a stop string appears in the text."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(self._token_logprob(token_id, logprob))
        if show_text and self.matched_stop is None:
            was_reasoning = self.parser.in_reasoning
            self._route(self.parser.feed(token_id, self.detokenizer.add(token_id)))
            self.reasoning_tokens += was_reasoning or self.parser.in_reasoning

    def finish(self) -> None:
        """Flush what was held back (partial characters, open tags, stop-string prefixes)."""
        if self.matched_stop is not None:
            return
        self._route(self.parser.feed(NO_TOKEN, self.detokenizer.flush()))
        self._route(self.parser.finish())
        if self.matched_stop is None:
            self.text.append(self.stop.flush())

    @property
    def has_tool_calls(self) -> bool:
        return self.parser.has_tool_calls

    def _route(self, delta) -> None:
        if self.matched_stop is not None:
            return
        self.reasoning.append(delta.reasoning)
        self.tool_calls.extend(delta.tool_calls)
        text, matched = self.stop.feed(delta.content)
        self.text.append(text)
        self.matched_stop = matched

    def take(self) -> dict:
        """The pending delta as RequestOutput fields; clears it."""
        fields = dict(
            token_ids=tuple(self.token_ids), text="".join(self.text), reasoning_text="".join(self.reasoning),
            tool_calls=tuple(self.tool_calls), logprobs=tuple(self.logprobs),
        )
        self._reset_pending()
        return fields

    def prompt_logprobs(self, token_ids: list[int], entries: list[SampleLogprobs | None]) -> tuple[TokenLogprob, ...]:
        """The prompt's tokens with their logprobs (entries[0] is None: nothing predicts the first)."""
        head = token_ids[0]
        first = TokenLogprob(head, self.tokenizer.decode([head]), self.tokenizer.token_bytes(head), None)
        return (first, *(self._token_logprob(t, lp) for t, lp in zip(token_ids[1:], entries[1:])))

    def _token_logprob(self, token_id: int, lp: SampleLogprobs) -> TokenLogprob:
        top = tuple(
            TokenLogprob(t, self.tokenizer.decode([t]), self.tokenizer.token_bytes(t), v)
            for t, v in zip(lp.top_ids, lp.top_logprobs)
        )
        return TokenLogprob(token_id, self.tokenizer.decode([token_id]), self.tokenizer.token_bytes(token_id),
                            lp.logprob, top)

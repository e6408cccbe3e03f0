"""Qwen output parsing: split generated tokens into reasoning text, content text and tool calls.

The parser sees what the detokenizer produces, one (token_id, text piece) pair per generated
token; a piece may be "" while a multi-byte character is incomplete. Qwen's <think>, </think>,
<tool_call> and </tool_call> are added tokens that are not special, so the state changes on their
ids (the model's ChatTokens), never on text, and their own text never reaches the output (except
inside a malformed tool call, which comes back verbatim as content). A tag the vocabulary lacks
is never written, so never switches anything.

Whitespace, as Qwen3 writes "<think>\\n...\\n</think>\\n\\n<tool_call>\\n{...}\\n</tool_call>":
- reasoning: one "\\n" right after <think> (or at the start, when the prompt opened the block)
  and the newlines right before </think> are dropped;
- content: leading whitespace after </think> and after a parsed tool call is dropped, and so is
  the whitespace right before a tool call that parses. To know that, content that ends in
  whitespace holds the whitespace back until more text follows (or finish()).

What is inside a <tool_call> block is read when it closes, by the model's format: Qwen3's JSON
(parse_json_calls) or Qwen3-Coder's XML (xml_tool_calls.py); tool_call_parsers.py picks one.
"""

import enum
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from xserv_engine.outputs import ToolCallDelta
from xserv_engine.tokenizer.chat_tokens import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START, ChatTokens


# a <tool_call> block's body -> [(name, arguments JSON)], or None when it is malformed
CallParser = Callable[[str], list[tuple[str, str]] | None]


@dataclass
class ParsedDelta:
    """What one token (or finish()) added to the answer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _Mode(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def prompt_opens_reasoning(prompt_ids: list[int], tokens: ChatTokens) -> bool:
    """True when the prompt leaves a <think> block open for the model to continue."""
    for token_id in reversed(prompt_ids):
        if token_id == tokens.think_start:
            return True
        if token_id == tokens.think_end:
            return False
    return False


class OutputParser:
    """Incremental parser for one choice: feed() every generated token, then finish() once."""

    def __init__(
        self,
        tokens: ChatTokens,
        *,
        starts_in_reasoning: bool,
        parse_reasoning: bool = True,
        parse_tools: bool = True,
        parse_call: CallParser | None = None,
        new_call_id: Callable[[], str] = new_tool_call_id,
    ):
        self.tokens = tokens
        self._tag_texts = tokens.tag_texts()
        self.parse_reasoning = parse_reasoning
        self.parse_tools = parse_tools
        self._parse_call = parse_call or parse_json_calls
        self._new_call_id = new_call_id
        in_reasoning = starts_in_reasoning and parse_reasoning
        self._mode = _Mode.REASONING if in_reasoning else _Mode.CONTENT
        self._strip_reasoning_newline = in_reasoning
        self._held_newlines = ""  # reasoning newlines that may turn out to precede </think>
        self._strip_content = False  # right after </think> or a parsed tool call
        self._held_whitespace = ""  # content whitespace that may turn out to precede <tool_call>
        self._call_prefix = ""  # the held whitespace that preceded the open <tool_call>
        self._call_body: list[str] = []
        self._num_tool_calls = 0

    @property
    def has_tool_calls(self) -> bool:
        return self._num_tool_calls > 0

    @property
    def in_reasoning(self) -> bool:
        return self._mode is _Mode.REASONING

    def feed(self, token_id: int, text: str) -> ParsedDelta:
        delta = ParsedDelta()
        if not self._is_tag(token_id):
            self._route(delta, text)
            return delta
        # A tag's piece may carry text the detokenizer held back from earlier tokens.
        before, tag, after = text.rpartition(self._tag_texts[token_id])
        if not tag:
            before, after = text, ""
        self._route(delta, before)
        self._switch(delta, token_id)
        self._route(delta, after)
        return delta

    def finish(self) -> ParsedDelta:
        """Flush what is held back; an unterminated tool call becomes content, verbatim."""
        delta = ParsedDelta()
        if self._mode is _Mode.TOOL_CALL:
            self._release_call_as_content(delta, closed=False)
        delta.reasoning += self._held_newlines
        delta.content += self._held_whitespace
        self._held_newlines = self._held_whitespace = ""
        return delta

    def _is_tag(self, token_id: int) -> bool:
        if token_id not in self._tag_texts:
            return False
        if token_id in (self.tokens.tool_call_start, self.tokens.tool_call_end):
            return self.parse_tools
        # Inside a tool call only </tool_call> ends the body; think tags are body text.
        return self.parse_reasoning and self._mode is not _Mode.TOOL_CALL

    def _route(self, delta: ParsedDelta, text: str) -> None:
        if self._mode is _Mode.REASONING:
            self._add_reasoning(delta, text)
        elif self._mode is _Mode.TOOL_CALL:
            self._call_body.append(text)
        else:
            self._add_content(delta, text)

    def _switch(self, delta: ParsedDelta, token_id: int) -> None:
        if token_id == self.tokens.think_start:
            if self._mode is _Mode.CONTENT:
                delta.content += self._held_whitespace
                self._held_whitespace = ""
                self._mode = _Mode.REASONING
                self._strip_reasoning_newline = True
        elif token_id == self.tokens.think_end:
            self._held_newlines = ""
            self._mode = _Mode.CONTENT
            self._strip_content = True
        elif token_id == self.tokens.tool_call_start:
            self._open_call(delta)
        elif self._mode is _Mode.TOOL_CALL:
            self._close_call(delta)
        # A stray </tool_call> outside a call is dropped.

    def _open_call(self, delta: ParsedDelta) -> None:
        if self._mode is _Mode.TOOL_CALL:  # the previous call never closed
            self._release_call_as_content(delta, closed=False)
        # A tool call ends an unclosed think block (the model skipped </think>).
        self._held_newlines = ""
        self._call_prefix, self._held_whitespace = self._held_whitespace, ""
        self._call_body = []
        self._mode = _Mode.TOOL_CALL

    def _close_call(self, delta: ParsedDelta) -> None:
        calls = self._parse_call("".join(self._call_body))
        if calls is None:
            self._release_call_as_content(delta, closed=True)
            return
        for name, arguments in calls:
            index = self._num_tool_calls
            self._num_tool_calls += 1
            # OpenAI's streaming shape: id and name first, then the argument fragments.
            delta.tool_calls.append(ToolCallDelta(index=index, id=self._new_call_id(), name=name))
            delta.tool_calls.append(ToolCallDelta(index=index, arguments=arguments))
        self._mode = _Mode.CONTENT
        self._strip_content = True

    def _release_call_as_content(self, delta: ParsedDelta, *, closed: bool) -> None:
        self._mode = _Mode.CONTENT
        text = TOOL_CALL_START + "".join(self._call_body) + (TOOL_CALL_END if closed else "")
        delta.content += self._call_prefix
        self._add_content(delta, text)

    def _add_reasoning(self, delta: ParsedDelta, text: str) -> None:
        if self._strip_reasoning_newline and text:
            self._strip_reasoning_newline = False
            text = text.removeprefix("\n")
        kept = text.rstrip("\n")
        if kept:
            delta.reasoning += self._held_newlines + kept
            self._held_newlines = ""
        self._held_newlines += text[len(kept) :]

    def _add_content(self, delta: ParsedDelta, text: str) -> None:
        if self._strip_content:
            text = text.lstrip()
            if not text:
                return
            self._strip_content = False
        if not self.parse_tools:
            delta.content += text
            return
        kept = text.rstrip()
        if kept:
            delta.content += self._held_whitespace + kept
            self._held_whitespace = ""
        self._held_whitespace += text[len(kept) :]


def parse_json_calls(body: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] from Qwen3's '{"name": ..., "arguments": ...}', or None when malformed."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    arguments = call.get("arguments")
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:  # a call without parameters
        return [(name, "{}")]
    if isinstance(arguments, str):
        return [(name, arguments)]
    if isinstance(arguments, dict):
        return [(name, json.dumps(arguments, ensure_ascii=False))]
    return None

"""What a request asks the engine to continue: plain text, token ids or a chat."""

from dataclasses import dataclass, field
from typing import Any, Union

from xserv_engine.errors import InvalidRequest


@dataclass(frozen=True)
class ChatInput:
    """OpenAI-shaped chat messages (dicts as transformers' apply_chat_template takes them)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    tool_choice: str = "auto"  # auto | none | required | a function name
    parallel_tool_calls: bool = True  # with a forced tool_choice: False allows exactly one call
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # enable_thinking, ...


PromptInput = Union[str, list[int], ChatInput]


def check_prompt(prompt: PromptInput, vocab_size: int) -> None:
    """Raise InvalidRequest for a prompt no model can continue. Field names are the gRPC
    request's (GenerateRequest.text, .token_ids, .chat.messages)."""
    if isinstance(prompt, ChatInput):
        if not prompt.messages:
            raise InvalidRequest("chat.messages", "must contain at least one message")
    elif isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("text", "must not be empty")
    elif not prompt:
        raise InvalidRequest("token_ids", "must not be empty")
    else:
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest("token_ids", f"token id {bad} is out of range (vocab size {vocab_size})")

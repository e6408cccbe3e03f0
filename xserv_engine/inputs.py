"""What a request asks the engine to continue: plain text, token ids or a chat."""

from dataclasses import dataclass, field
from typing import Any, Union


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

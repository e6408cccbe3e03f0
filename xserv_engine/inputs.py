"""What a request asks the engine to continue: plain text, token ids or a chat."""

from dataclasses import dataclass, field
from typing import Any, Union

from xserv_engine.errors import InvalidRequest


@dataclass(frozen=True)
class ChatInput:
    """OpenAI-shaped chat messages (dicts as transformers' apply_chat_template takes them). A
    message with images has its content as parts in order: {"type": "text", "text": ...} and
    {"type": "image", "image": <the encoded file's bytes>} (Qwen-VL templates render an image part
    as <|vision_start|><|image_pad|><|vision_end|>); other messages have a string."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    tool_choice: str = "auto"  # auto | none | required | a function name
    parallel_tool_calls: bool = True  # with a forced tool_choice: False allows exactly one call
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # enable_thinking, ...


@dataclass(frozen=True)
class TokenImages:
    """Token ids with one unexpanded image placeholder (<|image_pad|>) per image, in order, and
    the images: a prompt a router tokenized and rendered itself. Each image is its encoded bytes
    (SMG's media_refs) or the patches the router made of it (multimodal.image_processor's
    RouterPatches, from SMG's mm_inputs). `field` names the images in errors, as the client's
    request spells it."""

    token_ids: list[int]
    images: tuple  # bytes | RouterPatches each
    field: str = "media_refs.items"


PromptInput = Union[str, list[int], ChatInput, TokenImages]


def check_prompt(prompt: PromptInput, vocab_size: int) -> None:
    """Raise InvalidRequest for a prompt no model can continue. Field names are the gRPC
    request's (GenerateRequest.text, .token_ids, .chat.messages)."""
    if isinstance(prompt, ChatInput):
        if not prompt.messages:
            raise InvalidRequest("chat.messages", "must contain at least one message")
    elif isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("text", "must not be empty")
    else:
        ids = prompt.token_ids if isinstance(prompt, TokenImages) else prompt
        if not ids:
            raise InvalidRequest("token_ids", "must not be empty")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest("token_ids", f"token id {bad} is out of range (vocab size {vocab_size})")


def image_parts(prompt: PromptInput) -> list:
    """The prompt's images in order (empty for a text prompt): bytes, or a router's patches."""
    if isinstance(prompt, TokenImages):
        return list(prompt.images)
    return [part["image"] for _, _, part in _images(prompt)]


def check_images(prompt: PromptInput, model_id: str, accepts_images: bool, limit: int) -> None:
    """Raise InvalidRequest naming the first image (chat.messages[i].parts[j], or a TokenImages'
    field[k]) a model cannot take: any on a text-only model, one in a system message, the one
    past `limit`."""
    if isinstance(prompt, TokenImages):
        if prompt.images and not accepts_images:
            raise InvalidRequest(f"{prompt.field}[0]", f"{model_id} does not accept images")
        if len(prompt.images) > limit:
            raise InvalidRequest(f"{prompt.field}[{limit}]",
                                 f"at most {limit} image(s) per prompt (the engine's --limit-mm-per-prompt)")
        return
    for count, (i, j, _) in enumerate(_images(prompt), start=1):
        field = f"chat.messages[{i}].parts[{j}]"
        if not accepts_images:
            raise InvalidRequest(field, f"{model_id} does not accept images")
        if prompt.messages[i]["role"] == "system":
            raise InvalidRequest(field, "a system message cannot hold images; put them in a user message")
        if count > limit:
            raise InvalidRequest(field, f"at most {limit} image(s) per prompt (the engine's --limit-mm-per-prompt)")


def _images(prompt: PromptInput):
    """(message index, part index, part) of each image part."""
    if not isinstance(prompt, ChatInput):
        return
    for i, message in enumerate(prompt.messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") == "image":
                    yield i, j, part

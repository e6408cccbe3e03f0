"""POST /tokenize, POST /detokenize and GET /tokenizer_info: vLLM's tokenizer endpoints, which
clients that count tokens or render prompts themselves call (lm-evaluation-harness's
`tokenizer_backend=remote`, for one)."""

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from xserv.v1 import engine_pb2
from xserv_rest.protocol.base import Answer, FieldError, RequestBody, TokenId
from xserv_rest.protocol.chat import ChatMessages, ChatTemplateKwargs, chat_input
from xserv_rest.protocol.unsupported import unsupported

TokenStrings = unsupported("token strings are not implemented", lambda value: value is False, {"const": False})


class TokenizeRequest(RequestBody):
    """Either a text `prompt` or a chat (`messages`, rendered with the model's chat template)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = Field(None, description="the served model's id, or omitted")
    prompt: str = Field(None, description="text to tokenize as it is")
    messages: ChatMessages = Field(None, min_length=1, description="a chat, rendered first")
    add_generation_prompt: bool | None = Field(None, description="chat: end with the assistant's turn (default true)")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(None, description="chat: e.g. enable_thinking")
    tools: list[dict[str, Any]] | None = Field(None, description="chat: OpenAI tool definitions the template lists")
    add_special_tokens: bool | None = Field(None, description="accepted: Qwen3's tokenizer adds no special tokens")
    return_token_strs: TokenStrings = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give either 'prompt' (text) or 'messages' (a chat)")
        return self

    def to_grpc(self) -> engine_pb2.TokenizeRequest:
        if self.prompt is not None:
            return engine_pb2.TokenizeRequest(text=self.prompt)
        chat = chat_input(self.messages, self.tools, self.add_generation_prompt, self.chat_template_kwargs)
        return engine_pb2.TokenizeRequest(chat=chat)


class TokenizeResponse(Answer):
    count: int = Field(description="how many tokens")
    max_model_len: int = Field(description="the engine's context length, in tokens")
    tokens: list[int]
    token_strs: None = None


class DetokenizeRequest(RequestBody):
    model: str | None = Field(None, description="the served model's id, or omitted")
    tokens: list[TokenId] = Field(description="token ids to turn into text")


class DetokenizeResponse(Answer):
    prompt: str = Field(description="the text of the tokens")


class TokenizerInfo(Answer):
    tokenizer_class: str = "PreTrainedTokenizerFast"
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None = Field(description="the Jinja chat template the engine renders chats with")
    model_max_length: int = Field(description="the engine's context length, in tokens")
    vocab_size: int

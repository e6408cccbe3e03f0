"""A model directory's tokenizer: tokenizer.json (Hugging Face `tokenizers`) plus the special-token
flags, eos token and chat template from tokenizer_config.json / chat_template.jinja."""

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from xserv_engine.errors import InvalidRequest, ModelLoadError
from xserv_engine.inputs import ChatInput
from xserv_engine.tokenizer.byte_level import bytes_to_unicode
from xserv_engine.tokenizer.chat_tokens import ChatTokens
from xserv_engine.tokenizer.template import ChatTemplate


class Tokenizer:
    def __init__(self, hf: HFTokenizer, config: dict[str, Any], chat_template: str | None):
        self._hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(_special_ids(hf, config))
        self.special_tokens = _special_token_strings(config)  # bos_token, eos_token, pad_token, ...
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = hf.token_to_id(eos) if eos is not None else None
        self.chat_tokens = ChatTokens.lookup(hf.token_to_id)  # <think>, <tool_call>, ... by id
        self._token_bytes = _token_bytes_table(hf, self.vocab_size)
        self.chat_template = chat_template  # the Jinja source
        self._template = ChatTemplate(chat_template) if chat_template is not None else None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json (xserv needs a Hugging Face fast tokenizer)")
        try:
            hf = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise ModelLoadError(f"{tokenizer_file}: cannot be loaded: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        chat_template = template_file.read_text() if template_file.is_file() else _config_template(config)
        return cls(hf, config, chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; added tokens written in the text are recognized. The tokenizer's
        own special tokens (its post-processor's: Qwen3-Embedding's appends <|endoftext|>) only
        with add_special_tokens; Qwen3's generation tokenizer adds none either way."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def token_id(self, token: str) -> int | None:
        """The id of a token written as the vocabulary writes it ("yes"), or None."""
        return self._hf.token_to_id(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._hf.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (an added token: its UTF-8 text). Ids past the
        tokenizer (a model's padded embedding rows) stand for nothing."""
        return self._token_bytes[token_id] if token_id < len(self._token_bytes) else b""

    def render_chat(self, chat: ChatInput) -> str:
        """The prompt text the model's chat template makes of `chat`."""
        if self._template is None:
            raise InvalidRequest("messages", "this model has no chat template; send a text prompt instead")
        variables = {
            **self.special_tokens,
            **chat.template_kwargs,
            "messages": chat.messages,
            "tools": chat.tools,
            "tool_choice": chat.tool_choice,
            "add_generation_prompt": chat.add_generation_prompt,
        }
        return self._template.render(variables)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e


def _config_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_token_strings(config: dict[str, Any]) -> dict[str, str]:
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    strings = {name: _token_text(config.get(name)) for name in names}
    return {name: text for name, text in strings.items() if text is not None}


def _special_ids(hf: HFTokenizer, config: dict[str, Any]) -> set[int]:
    """Added tokens flagged special; tokenizer_config.json's added_tokens_decoder wins."""
    flags = {token_id: added.special for token_id, added in hf.get_added_tokens_decoder().items()}
    for token_id, entry in config.get("added_tokens_decoder", {}).items():
        flags[int(token_id)] = bool(entry.get("special", False))
    return {token_id for token_id, special in flags.items() if special}


def _token_bytes_table(hf: HFTokenizer, vocab_size: int) -> list[bytes]:
    """id -> bytes for every token. Byte-level vocab strings map back char by char."""
    to_latin1 = str.maketrans({char: chr(byte) for byte, char in bytes_to_unicode().items()})
    table = [b""] * vocab_size
    for token, token_id in hf.get_vocab(with_added_tokens=False).items():
        try:
            table[token_id] = token.translate(to_latin1).encode("latin-1")
        except UnicodeEncodeError:
            raise ModelLoadError(f"token {token!r} is not byte-level BPE, the only kind xserv serves") from None
    for token_id, added in hf.get_added_tokens_decoder().items():
        table[token_id] = added.content.encode()
    return table

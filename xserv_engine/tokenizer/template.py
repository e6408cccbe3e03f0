"""Renders a model's jinja2 chat template the way transformers' apply_chat_template does."""

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from xserv_engine.errors import InvalidRequest, ModelLoadError


def _raise_exception(message: str):
    # the template rejects the conversation (e.g. roles out of order): the caller's error
    raise InvalidRequest("messages", message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    # transformers' filter, not jinja2's (which escapes HTML and sorts keys)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. Compile once per model; render per request."""

    def __init__(self, source: str):
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"chat template does not compile: {e}") from e

    def render(self, variables: dict[str, Any]) -> str:
        """Prompt text for `variables` (messages, tools, add_generation_prompt, bos_token,
        eos_token and any template kwargs such as enable_thinking).

        A conversation the template rejects or cannot render (raise_exception, a missing or
        mistyped field) is the caller's error: InvalidRequest("messages", ...).
        """
        try:
            return self._template.render(**variables)
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError) as e:
            raise InvalidRequest("messages", f"the chat template cannot render these messages: {e}") from e

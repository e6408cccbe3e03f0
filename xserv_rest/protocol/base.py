"""What every protocol model shares: JSON's own types (strict: "7" is no integer, 1 no boolean),
bounded numbers built from the engine's BOUNDS, the runtime limits that arrive through
pydantic's validation context, and the unknown-field warning of request bodies."""

import logging
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, model_validator

from xserv_engine.sampling_params import BOUNDS, MAX_N, U32
from xserv_engine.media import MediaPolicy

log = logging.getLogger("xserv.rest")


@dataclass(frozen=True)
class Limits:
    """This server's limits, passed as validate(..., context={"limits": Limits(...)})."""

    max_n: int = MAX_N  # --max-n
    max_model_len: int | None = None  # the engine's context, when known
    embedding_size: int | None = None  # an embedding model's width (most `dimensions`), when known
    media: MediaPolicy = MediaPolicy()  # how image URLs are loaded (default: data: URLs only)
    max_images: int | None = None  # most images per chat (0: the model takes none), when known

    @staticmethod
    def of(info: ValidationInfo) -> "Limits":
        return (info.context or {}).get("limits") or Limits()


class FieldError(ValueError):
    """A rule across fields, raised by a model validator, that names the field to blame."""

    def __init__(self, field: str, message: str, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code


class Model(BaseModel):
    """Nested objects: JSON types are strict, numbers finite, unknown keys dropped."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class Answer(BaseModel):
    """What the server sends: checked as it is built (lax types), no key beyond the declared ones."""

    model_config = ConfigDict(extra="forbid")


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class AnswerHead(Answer):
    """The keys every completion answer and chunk starts with (in OpenAI's order); each
    subclass narrows `object` to its own literal."""

    id: str
    object: str
    created: int
    model: str


# field names already warned about: each is logged once per process (a client such as llama.cpp's
# sends `cache_prompt` with every request), then at DEBUG; bounded against clients that invent names
_WARNED_FIELDS: set[str] = set()
_MAX_WARNED_FIELDS = 256


class RequestBody(Model):
    """A request's top-level body: fields unknown to OpenAI's API and to xserv are ignored, as
    vLLM ignores them, with a warning the first time each name arrives (then at DEBUG)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _warn_unknown(self) -> "RequestBody":
        if self.model_extra:
            new = sorted(set(self.model_extra) - _WARNED_FIELDS)
            if new and len(_WARNED_FIELDS) < _MAX_WARNED_FIELDS:
                _WARNED_FIELDS.update(new)
                # repr: a client's key may hold a newline, which must not forge a log line
                log.warning("ignored request fields unknown to the API: %s (each name is logged once)",
                            ", ".join(map(repr, new)))
            else:
                log.debug("ignored request fields unknown to the API: %s", ", ".join(map(repr, sorted(self.model_extra))))
        return self


def _integral(value: Any) -> Any:
    """JSON does not tell 7 from 7.0: an integral number is an integer, as JSON Schema's."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _range(name: str) -> Field:
    bounds = BOUNDS[name]
    low = {"gt": bounds.low} if bounds.low_open else {"ge": bounds.low}
    return Field(**low, le=bounds.high)


def integer(name: str | None = None) -> Any:
    """A JSON integer, within BOUNDS[name] when named."""
    return Annotated[int, _range(name) if name else Field(), BeforeValidator(_integral)]


def number(name: str) -> Any:
    """A finite JSON number within BOUNDS[name]."""
    return Annotated[float, _range(name)]


def described(name: str, extra: str = "") -> Any:
    """Field(None, description=...) from BOUNDS[name]'s description."""
    return Field(None, description=" ".join(filter(None, (BOUNDS[name].description, extra))))


def omitted() -> Any:
    """An answer field left out of the JSON while it is None (OpenAI's optional keys)."""
    return Field(None, exclude_if=lambda value: value is None)


def needs_true(field: str, name: str) -> dict:
    """JSON Schema: `field`, when given (not null), needs `name: true` (a FieldError rule)."""
    return {"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
            "then": {"required": [name], "properties": {name: {"const": True}}}}


TokenId = Annotated[int, Field(ge=0, le=U32), BeforeValidator(_integral)]
PositiveU32 = Annotated[int, Field(ge=1, le=U32), BeforeValidator(_integral)]

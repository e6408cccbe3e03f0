"""OpenAI fields that xserv does not implement.

A field that would change what the model must produce is refused (400 naming it) unless its
value asks for nothing more than xserv does (modalities ["text"], response_format text); the
document shows only the values that are accepted. Fields that change nothing xserv produces
(user, metadata, store, ...) are plain optional fields of the models, accepted and unused.
"""

from typing import Annotated, Any, Callable

from pydantic import AfterValidator, WithJsonSchema
from pydantic_core import PydanticCustomError


def unsupported(why: str, accepts: Callable[[Any], bool] = lambda value: False, schema: dict | None = None) -> Any:
    """A field whose values other than null (and those `accepts`, documented by `schema`) are a 400."""

    def check(value: Any) -> Any:
        if value is not None and not accepts(value):
            raise PydanticCustomError("unsupported", "is not supported: {why}", {"why": why})
        return value

    accepted = [schema] if schema else []
    return Annotated[Any, AfterValidator(check),
                     WithJsonSchema({"anyOf": accepted + [{"type": "null"}], "description": f"not supported: {why}"})]


def only_text_modalities(value: Any) -> bool:
    return isinstance(value, list) and all(modality == "text" for modality in value)


Audio = unsupported("xserv generates text only")
Modalities = unsupported("xserv generates text only", only_text_modalities,
                         {"type": "array", "items": {"const": "text"}})
Prediction = unsupported("predicted outputs are not implemented")
WebSearch = unsupported("xserv has no web search")
LegacyFunctions = unsupported("the deprecated functions API; use tools")
ReasoningEffort = unsupported("Qwen3 has no effort levels; use chat_template_kwargs.enable_thinking")
Verbosity = unsupported("xserv cannot steer verbosity")
Suffix = unsupported("suffix (insertion) is not implemented")
BestOf = unsupported("best_of is not implemented", lambda value: type(value) is int and value == 1, {"const": 1})

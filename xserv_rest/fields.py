"""Typed access to a JSON request body: every wrong type becomes a 400 naming the field."""

import math
from typing import Any

from xserv_rest.errors import invalid_request

_MISSING = object()


class Fields:
    """Reads one JSON object; `where` prefixes field names in errors ("messages[2].content")."""

    def __init__(self, data: Any, where: str = ""):
        if not isinstance(data, dict):
            raise invalid_request(f"{where or 'the request body'} must be a JSON object", param=where or None)
        self.data = data
        self.where = where

    def param(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def string(self, name: str, default: str | None = None) -> str | None:
        return self._typed(name, default, lambda v: isinstance(v, str), "a string")

    def boolean(self, name: str, default: bool | None = None) -> bool | None:
        return self._typed(name, default, lambda v: isinstance(v, bool), "a boolean")

    def integer(self, name: str, default: int | None = None) -> int | None:
        value = self._typed(name, default, _is_integral, "an integer")
        return None if value is None else int(value)

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self._typed(name, default, _is_number, "a number")
        return None if value is None else float(value)

    def array(self, name: str, default: list | None = None) -> list | None:
        return self._typed(name, default, lambda v: isinstance(v, list), "an array")

    def object(self, name: str) -> "Fields | None":
        value = self.data.get(name)
        return None if value is None else Fields(value, self.param(name))

    def _typed(self, name: str, default: Any, ok, kind: str) -> Any:
        value = self.data.get(name, _MISSING)
        if value is _MISSING or value is None:
            return default
        if not ok(value):
            raise invalid_request(f"'{self.param(name)}' must be {kind}, got {type(value).__name__}",
                                  param=self.param(name))
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_integral(value: Any) -> bool:
    return _is_number(value) and float(value).is_integer()

"""LoraRegistry: the LoRA adapters an engine serves, by name, and the errors of asking for them.

Loading reads a PEFT directory (slow) on the caller's thread; the engine thread sees an adapter
from the next request that names it on. Unloading stops new requests from naming it; running
ones finish with it.
"""

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from xserv_engine.errors import InvalidRequest, NotFound, Unsupported

if TYPE_CHECKING:  # models/lora.py imports torch
    from xserv_engine.models.lora import LoraAdapter

NO_LORA = "this engine serves no LoRA adapters: start it with --enable-lora or --lora-modules"


def not_loaded(name: str, loaded: list[str] | None = None) -> NotFound:
    """The error for a name no loaded adapter has; `loaded` lists the names there are."""
    listed = "" if loaded is None else f" (loaded: {', '.join(loaded) or 'none'})"
    return NotFound("lora_name", f"LoRA adapter {name!r} is not loaded{listed}")


class LoraRegistry(Mapping):
    """name -> LoraAdapter, in load order. `read` loads a directory: (name, path) -> LoraAdapter."""

    def __init__(self, enabled: bool, base_model_id: str, read: Callable[[str, str], "LoraAdapter"]):
        self.enabled = enabled
        self._base_model_id = base_model_id
        self._read = read
        self._adapters: dict[str, LoraAdapter] = {}

    def __getitem__(self, name: str) -> "LoraAdapter":
        return self._adapters[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)

    def adapters(self) -> list["LoraAdapter"]:
        """A snapshot, safe while another thread loads or unloads."""
        return list(self._adapters.values())

    def get_adapter(self, name: str) -> "LoraAdapter":
        """The adapter a request names (NotFound if none has the name)."""
        adapter = self._adapters.get(name)
        if adapter is None:
            raise not_loaded(name, list(self._adapters))
        return adapter

    def load(self, name: str, path: str) -> "LoraAdapter":
        """Read a PEFT adapter directory and serve it under `name` (any thread)."""
        if not self.enabled:
            raise Unsupported(NO_LORA)
        if not name:
            raise InvalidRequest("lora_name", "the adapter's name is empty")
        if name in self._adapters or name == self._base_model_id:
            raise self._taken(name)
        adapter = self._read(name, path)
        if self._adapters.setdefault(name, adapter) is not adapter:  # the same name loaded meanwhile
            raise self._taken(name)
        return adapter

    def unload(self, name: str) -> None:
        if not self.enabled:
            raise Unsupported(NO_LORA)
        if self._adapters.pop(name, None) is None:
            raise not_loaded(name)

    def _taken(self, name: str) -> InvalidRequest:
        what = "a loaded adapter" if name in self._adapters else "the base model"
        return InvalidRequest("lora_name", f"{name!r} is already the name of {what}")

"""Compiled grammars by constraint key, least recently used first out; safe from any thread."""

import threading
from collections import OrderedDict
from typing import Callable

from xserv_engine.structured.backend import Grammar


class GrammarCache:
    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._grammars: OrderedDict[tuple, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple, compile_fn: Callable[[], Grammar]) -> Grammar:
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                self.hits += 1
                return grammar
        grammar = compile_fn()  # outside the lock: a slow schema does not hold up other requests
        with self._lock:
            self.misses += 1
            self._grammars[key] = grammar
            self._grammars.move_to_end(key)
            while len(self._grammars) > self.capacity:
                self._grammars.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._grammars)

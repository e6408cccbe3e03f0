"""What makes an in-process engine start cheap in tests, applied to a pytest.MonkeyPatch:

- no CPU warm-up: its dummy prefills of the whole token budget (seconds per engine on the demo
  model) change no output, which tests/engine/test_warmup.py checks with the real one
  (CPU_WARMUP);
- shared vocabulary loads: every start reads its model's vocabulary twice, together over a
  second of CPU, for the tokenizer (and every token's bytes) and for the grammar backend
  (llguidance). Engines share the tokenizer of the same tokenizer files (by content) and the
  grammar backend of the same vocabulary and eos ids. The loaders themselves are tested in
  tests/tokenizer and tests/structured;
- the grammar backend read on first use: a start reads it beside its own warm-up (a second of CPU
  per vocabulary), which most engines of tests never ask for.

Engines of end-to-end tests are real processes and start as in production.
"""

import hashlib
import threading
from pathlib import Path

import pytest

from xserv_engine.engine import engine_setup
from xserv_engine.engine.model_runner import ModelRunner
from xserv_engine.structured import llguidance_backend
from xserv_engine.structured.manager import StructuredOutputManager
from xserv_engine.tokenizer.tokenizer import Tokenizer

CPU_WARMUP = ModelRunner.warmup
GRAMMAR_BACKEND = llguidance_backend.LLGuidanceBackend
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LOAD_GRAMMAR_BACKEND = StructuredOutputManager._load
GRAMMAR_BACKEND_OF = StructuredOutputManager.backend.fget


def cheap_engine_starts(patch: pytest.MonkeyPatch) -> None:
    tokenizers, backends, digests = {}, {}, {}

    def digest(file: Path) -> bytes | None:  # of a file's content, read once per version of it
        if not file.is_file():
            return None
        stat = file.stat()
        version = (str(file), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if version not in digests:
            digests[version] = hashlib.sha1(file.read_bytes()).digest()
        return digests[version]

    class SharedTokenizer:
        @staticmethod
        def from_dir(path) -> Tokenizer:
            key = tuple(digest(Path(path) / name) for name in TOKENIZER_FILES)
            if key not in tokenizers:
                tokenizers[key] = Tokenizer.from_dir(path)
            return tokenizers[key]

    def shared_backend(tokenizer_json: str, eos_token_ids):
        key = (tokenizer_json, tuple(eos_token_ids))
        if key not in backends:
            backends[key] = GRAMMAR_BACKEND(tokenizer_json, eos_token_ids)
        return backends[key]

    first_use = threading.Lock()

    def load_later(manager, *args) -> None:  # on the manager's loader thread, as the real load
        manager.load_args = args

    def backend_on_first_use(manager):
        manager._loader.join()
        with first_use:
            if not manager._loaded.is_set():
                LOAD_GRAMMAR_BACKEND(manager, *manager.load_args)
        return GRAMMAR_BACKEND_OF(manager)

    patch.setattr(ModelRunner, "warmup", lambda self, *args, **kwargs: None)
    patch.setattr(StructuredOutputManager, "_load", load_later)
    patch.setattr(StructuredOutputManager, "backend", property(backend_on_first_use))
    patch.setattr(engine_setup, "Tokenizer", SharedTokenizer)
    patch.setattr(llguidance_backend, "LLGuidanceBackend", shared_backend)

from pathlib import Path

import pytest

from xserv_engine.demo import write_demo_model
from xserv_engine.engine import engine_setup
from xserv_engine.engine.model_runner import ModelRunner
from xserv_engine.structured import llguidance_backend
from xserv_engine.tokenizer.tokenizer import Tokenizer

# Fixtures that start a real process: a test that uses one is end to end (the `e2e` marker),
# also in modules that are otherwise in-process.
PROCESS_FIXTURES = {"front", "two_worker_front"}
CPU_WARMUP = ModelRunner.warmup
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def pytest_collection_modifyitems(items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo checkpoint, written once per test session (deriving the merges takes seconds)."""
    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def no_cpu_warmup():
    """Engines built in this process start without the CPU warm-up: its dummy prefills of the
    whole token budget (seconds per engine on the demo model) change no output, which
    tests/engine/test_warmup.py checks with the real one (the `cpu_warmup` fixture). Engines in
    end-to-end tests are real processes and warm up as in production."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelRunner, "warmup", lambda self, *args, **kwargs: None)
        yield


@pytest.fixture
def cpu_warmup(monkeypatch):
    """The real CPU warm-up, for the tests of it."""
    monkeypatch.setattr(ModelRunner, "warmup", CPU_WARMUP)


@pytest.fixture(scope="session", autouse=True)
def engines_share_vocabulary_loads():
    """Every engine start reads its model's vocabulary twice, together over a second of CPU: the
    tokenizer (and every token's bytes) and the grammar backend (llguidance). Engines built in
    this process share the tokenizer of a model directory whose tokenizer files are unchanged,
    and the grammar backend of the same vocabulary and eos ids. The loaders themselves are
    tested in tests/tokenizer and tests/structured; end-to-end engines load their own."""
    tokenizers, backends = {}, {}

    class SharedTokenizer:
        @staticmethod
        def from_dir(path) -> Tokenizer:
            files = [Path(path) / name for name in TOKENIZER_FILES]
            key = (str(path), *((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None for f in files))
            if key not in tokenizers:
                tokenizers[key] = Tokenizer.from_dir(path)
            return tokenizers[key]

    def shared_backend(tokenizer_json: str, eos_token_ids):
        key = (tokenizer_json, tuple(eos_token_ids))
        if key not in backends:
            backends[key] = grammar_backend(tokenizer_json, eos_token_ids)
        return backends[key]

    grammar_backend = llguidance_backend.LLGuidanceBackend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_setup, "Tokenizer", SharedTokenizer)
        patch.setattr(llguidance_backend, "LLGuidanceBackend", shared_backend)
        yield

"""Structured-output fixtures: the demo model (random weights, the real Qwen vocabulary) is the
best adversary: without the mask it never writes JSON, so every valid answer is the mask's work."""

import pytest

from tests.engine.conftest import make_engine
from xserv_engine.structured.llguidance_backend import LLGuidanceBackend

EOS_IDS = [151645, 151643]


@pytest.fixture(scope="session")
def backend(demo_dir):
    return LLGuidanceBackend((demo_dir / "tokenizer.json").read_text(), EOS_IDS)


@pytest.fixture(scope="module")
def engine(demo_dir):
    engine = make_engine(demo_dir, max_model_len=1024, num_kv_blocks=512)
    yield engine
    engine.shutdown()

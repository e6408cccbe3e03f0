import pytest

from xserv_engine.demo import write_demo_model
from xserv_engine.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo checkpoint, written once per test session (deriving the merges takes seconds)."""
    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)

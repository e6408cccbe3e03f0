import pytest

from xserv_engine.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)

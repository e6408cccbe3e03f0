import pytest

from xserv_engine.demo import write_demo_model


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo checkpoint, written once per test session (deriving the merges takes seconds)."""
    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    return path

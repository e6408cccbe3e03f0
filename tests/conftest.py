import pytest

from tests.support.engine_starts import CPU_WARMUP, cheap_engine_starts
from xserv_engine.demo import write_demo_model
from xserv_engine.engine.model_runner import ModelRunner

# Fixtures that start a real process: a test that uses one is end to end (the `e2e` marker),
# also in modules that are otherwise in-process.
PROCESS_FIXTURES = {"front", "two_worker_front"}


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
def engines_start_cheaply():
    """In-process engines start without the CPU warm-up and share vocabulary loads
    (tests/support/engine_starts.py)."""
    with pytest.MonkeyPatch.context() as patch:
        cheap_engine_starts(patch)
        yield


@pytest.fixture
def cpu_warmup(monkeypatch):
    """The real CPU warm-up, for the tests of it."""
    monkeypatch.setattr(ModelRunner, "warmup", CPU_WARMUP)

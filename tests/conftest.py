import pytest

from xserv_engine.demo import write_demo_model
from xserv_engine.engine.model_runner import ModelRunner

# Fixtures that start a real process: a test that uses one is end to end (the `e2e` marker),
# also in modules that are otherwise in-process.
PROCESS_FIXTURES = {"front", "two_worker_front"}
CPU_WARMUP = ModelRunner.warmup


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

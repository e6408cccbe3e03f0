"""Root fixtures. It imports torch and the engine only inside hooks and fixtures: pytest-xdist's
controller process loads this file too, and never runs a test."""

import fcntl
import os
from pathlib import Path

import pytest

from tests.support.reference import REFERENCE, SKIP_REASON, is_marked, marked_tests

# Fixtures that start a real process: a test that uses one is end to end (the `e2e` marker),
# also in modules that are otherwise in-process.
PROCESS_FIXTURES = {"front", "two_worker_front"}


def pytest_configure(config):
    """Under pytest-xdist (-n N) each worker runs torch on its share of the cores: N workers with
    every core's OpenMP threads each oversubscribe the CPU, which costs more CPU and wall time than
    the parallelism gains. Serial runs (CI's) keep torch's default, every core."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(config, items):
    marked = marked_tests(Path(__file__).parent)
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        if bool(item.get_closest_marker("reference")) != is_marked(item.nodeid, marked):
            raise pytest.UsageError(f"{item.nodeid}: put the `reference` marker on the test function or in the "
                                    "module's pytestmark, where tests/support/reference.py counts it")
        if not REFERENCE.is_dir() and item.get_closest_marker("reference"):
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


def pytest_report_header(config):
    if REFERENCE.is_dir():
        return f"reference: {REFERENCE} found; the tests marked `reference` compare with it"
    return f"reference: {REFERENCE} is ABSENT; the tests marked `reference` will skip (counted below)"


def reference_count(nodeids: list[str]) -> str:
    marked = marked_tests(Path(__file__).parent)
    count = sum(is_marked(nodeid, marked) for nodeid in nodeids)
    if REFERENCE.is_dir():
        return f"reference: {count} of {len(nodeids)} tests read {REFERENCE}; they would skip without it"
    return f"reference: {count} of {len(nodeids)} tests will SKIP: {SKIP_REASON}"


def pytest_report_collectionfinish(config, items):
    return reference_count([item.nodeid for item in items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under -n the controller never collects; the first worker to finish says the count."""
    config = node.config
    if not getattr(config, "_reference_counted", False):
        config._reference_counted = True
        if terminal := config.pluginmanager.get_plugin("terminalreporter"):
            terminal.write_line(reference_count(list(ids)))


@pytest.fixture(scope="session")
def otlp():
    """A real OTLP trace receiver on a free loopback port (tests/support/otlp_receiver.py)."""
    from tests.support.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        yield receiver


def written_once(tmp_path_factory, name: str, write) -> Path:
    """A directory that write(path) fills, once per test run: pytest-xdist's workers share their
    run's temporary root, where the first to ask writes it under a lock while the others wait."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        write(path)
        return path
    root = tmp_path_factory.getbasetemp().parent
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_dir():
            partial = tmp_path_factory.mktemp(name)
            write(partial)
            partial.rename(path)
    return path


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo checkpoint, written once per test run (deriving the merges takes seconds); tests
    only read it."""
    from xserv_engine.demo import write_demo_model

    return written_once(tmp_path_factory, "demo-model", write_demo_model)


@pytest.fixture(scope="session")
def demo_qwen3_5_dir(tmp_path_factory):
    """The Qwen3.5 demo checkpoint (xserv_engine/demo_qwen3_5.py), written once per test run."""
    from xserv_engine.demo import write_demo_model
    from xserv_engine.demo_qwen3_5 import QWEN3_5_DEMO

    return written_once(tmp_path_factory, "demo-qwen3_5-model", lambda path: write_demo_model(path, model=QWEN3_5_DEMO))


@pytest.fixture(scope="session")
def embedding_checkpoint(tmp_path_factory, demo_dir):
    """(directory, its transformers Qwen3Model): a random-weight checkpoint in Qwen3-Embedding's
    layout (tests/support/embedding_checkpoint.py), written once per session."""
    from tests.support.embedding_checkpoint import write_embedding_checkpoint

    path = tmp_path_factory.mktemp("qwen3-embedding")
    return path, write_embedding_checkpoint(path, demo_dir)


@pytest.fixture(scope="session")
def reranker_checkpoint(tmp_path_factory, demo_dir):
    """(directory, its transformers Qwen3ForCausalLM): a random-weight Qwen3 checkpoint with an
    untied head, in the shape of a reranker, written once per session."""
    from tests.engine.conftest import save_hf_model

    path = tmp_path_factory.mktemp("reranker")
    return path, save_hf_model(path, demo_dir, tie=False)


@pytest.fixture(scope="session", autouse=True)
def engines_start_cheaply():
    """In-process engines start without the CPU warm-up and share vocabulary loads
    (tests/support/engine_starts.py)."""
    from tests.support.engine_starts import cheap_engine_starts

    with pytest.MonkeyPatch.context() as patch:
        cheap_engine_starts(patch)
        yield


@pytest.fixture
def cpu_warmup(monkeypatch):
    """The real CPU warm-up, for the tests of it."""
    from tests.support.engine_starts import CPU_WARMUP
    from xserv_engine.engine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "warmup", CPU_WARMUP)

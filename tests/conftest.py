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

# In-process tests among the slowest of the fast tier (each 10-30 s under load, `--durations=30`,
# 2026-12-07), run with the e2e tier to keep the fast tier short: a sibling parametrization or
# another test of the same path stays in the fast tier for each.
SLOW_IN_PROCESS = (
    "tests/engine/test_speculative.py::test_drafts_drawn_from_a_draft_distribution_keep_the_targets[top_p]",
    "tests/engine/test_speculative.py::test_drafts_drawn_from_a_draft_distribution_keep_the_targets[top_k]",
    "tests/engine/test_speculative.py::test_a_draft_model_gives_the_same_greedy_tokens_and_reproducible_samples",
    "tests/engine/test_speculative.py::test_the_engine_turns_off_a_lookup_that_is_measured_slower_and_keeps_greedy_output",
    "tests/structured/test_grammars.py::test_the_constraint_starts_after_the_reasoning[qwen3_5]",
    "tests/engine/test_fidelity.py::test_greedy_continuations_equal_transformers_generate[tied]",
    "tests/engine/test_int8.py::test_an_int8_engine_predicts_what_the_full_precision_model_predicts[tied-native-float32]",
    "tests/engine/test_moe.py::test_greedy_batch_with_chunked_prefill_equals_transformers_generate"
    "[every-2nd-layer-sparse,unnormalized,tied-native]",
    "tests/engine/test_moe.py::test_greedy_batch_with_chunked_prefill_equals_transformers_generate"
    "[every-2nd-layer-sparse,unnormalized,tied-grouped]",
    "tests/engine/test_hybrid_models.py::test_greedy_tokens_of_a_staggered_batch_equal_transformers"
    "[qwen3_5,v4-over-k2,tied-whole-prompts]",
    "tests/engine/test_hybrid_models.py::test_greedy_tokens_of_a_staggered_batch_equal_transformers"
    "[qwen3_5_moe,shared-expert,untied,sharded-whole-prompts]",
    "tests/engine/test_hybrid_models.py::test_preempted_sequences_start_their_states_over_and_answer_the_same"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
)


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
    for entry in SLOW_IN_PROCESS:
        path, name = entry.split("[")[0].split("::")
        if f"def {name}(" not in (Path(config.rootpath) / path).read_text():
            raise pytest.UsageError(f"SLOW_IN_PROCESS in tests/conftest.py names {entry}, which is gone")
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) or item.nodeid in SLOW_IN_PROCESS:
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

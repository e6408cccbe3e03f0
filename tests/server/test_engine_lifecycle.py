"""The `xserv engine` process's life: readiness while loading, a full queue, SIGTERM drains."""

import importlib.util
import json
import shutil
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from xserv.v1 import engine_pb2

from tests.conftest import written_once
from tests.support.processes import REPO

from .engine_process import EngineProcess

pytestmark = pytest.mark.e2e


@pytest.fixture
def log_path(tmp_path):
    return tmp_path / "engine.log"


def first_health_answer(engine: EngineProcess, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return engine.health_status()
        except grpc.RpcError:
            time.sleep(0.02)
    raise TimeoutError(engine.log_text())


def test_loading_then_full_queue_then_drain_cuts_endless_streams(log_path):
    # --max-model-len 4096: the running stream's 4000 tokens outlast the checks and the grace
    # (the demo model decodes 480 tokens in ~1 s, the grace's length)
    engine = EngineProcess("--max-num-seqs", "1", "--max-queued-requests", "1", "--drain-grace", "1",
                           "--max-model-len", "4096", log_path=log_path)
    try:
        # Listening before the model is loaded: readiness is visible, calls are refused.
        assert first_health_answer(engine) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as error:
            list(engine.generate(max_tokens=2))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        engine.wait_serving()

        running = engine.generate(max_tokens=4000, ignore_eos=True)
        next(running)  # running: the one sequence slot is taken
        waiting = engine.generate(max_tokens=2)  # accepted, waits for the slot
        deadline = time.monotonic() + 10
        while engine.model_info().num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as error:
            list(engine.generate(max_tokens=2))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in error.value.details()

        engine.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError):
            list(running)  # not done within the 1 s grace: ended by the server
        with pytest.raises(grpc.RpcError):
            list(waiting)
        assert engine.proc.wait(timeout=30) == 0
    finally:
        engine.stop()


def test_sigterm_lets_a_running_stream_finish_and_exits_0(log_path):
    engine = EngineProcess("--drain-grace", "120", "--max-model-len", "2048", log_path=log_path)
    try:
        engine.wait_serving()
        # still running after the checks below (one stream decodes at 80-250 tok/s on 2 cores;
        # 100 tokens once ended first), within the grace even when the parallel test worker
        # slows it several-fold (tests/reliability/test_drain.py ran past a 30 s grace once)
        running = engine.generate(max_tokens=1200, ignore_eos=True)
        next(running)
        engine.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert engine.health_status() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as error:
            list(engine.generate(max_tokens=2))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(running)
        assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert rest[-1].usage.completion_tokens == 1200
        assert engine.proc.wait(timeout=30) == 0
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def slow_loading_model(tmp_path_factory, demo_dir):
    """A random checkpoint that takes seconds to load and quantize: Qwen3-0.6B's layer shape, 4
    layers, ~440 MB (benchmarks/make_random_model.py's weights)."""
    def write(path: Path) -> None:
        spec = importlib.util.spec_from_file_location("make_random_model", Path(REPO) / "benchmarks" / "make_random_model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in module.COPIED:
            shutil.copy(demo_dir / name, path / name)
        config = json.loads((demo_dir / "config.json").read_text()) | {
            "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128}
        (path / "config.json").write_text(json.dumps(config))
        module.write_weights(path, config, seed=0)

    return written_once(tmp_path_factory, "slow-loading-model", write)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_model_loads_ends_the_process_at_once_with_0(log_path, slow_loading_model, signum):
    """Ctrl-C while a model loads and is quantized: the process ends then, cleanly. It aborted
    ("terminate called without an active exception", exit 134) when the interpreter finalized
    under the loading thread, still inside torch's native code."""
    engine = EngineProcess("--model", str(slow_loading_model), "--quantization", "int8", "--log-level", "info",
                           log_path=log_path)
    try:
        deadline = time.monotonic() + 120
        while "warming up" not in engine.log_text():  # the loading thread runs forward passes now
            assert time.monotonic() < deadline and engine.proc.poll() is None, engine.log_text()
            time.sleep(0.01)
        engine.proc.send_signal(signum)
        assert engine.proc.wait(timeout=30) == 0, engine.log_text()
        assert "stopped while loading the model" in engine.log_text()
        assert "terminate called" not in engine.log_text()
    finally:
        engine.stop()


def test_a_missing_model_directory_exits_1_with_a_one_line_reason(log_path):
    engine = EngineProcess("--model", "/nonexistent/qwen3", log_path=log_path)
    try:
        assert engine.proc.wait(timeout=60) == 1
        assert "could not load the engine: model directory /nonexistent/qwen3 does not exist" in engine.log_text()
        assert "Traceback" not in engine.log_text()
    finally:
        engine.stop()


def test_a_taken_port_exits_1_instead_of_sharing_it(log_path):
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another gRPC server binds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        engine = EngineProcess(log_path=log_path, port=taken.getsockname()[1])
        try:
            assert engine.proc.wait(timeout=60) == 1
            assert f"cannot listen on 127.0.0.1:{engine.port}" in engine.log_text()
        finally:
            engine.stop()


def test_an_unexpected_load_failure_logs_the_cause_with_its_traceback(log_path, tmp_path, demo_dir):
    model = tmp_path / "truncated"
    shutil.copytree(demo_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # a download cut short
    engine = EngineProcess("--model", str(model), log_path=log_path)
    try:
        assert engine.proc.wait(timeout=60) == 1
        log = engine.log_text()
        assert "could not load the engine:" in log and "Traceback (most recent call last)" in log
        assert "NoneType: None" not in log
    finally:
        engine.stop()

"""The `xserv engine` process's life: readiness while loading, a full queue, SIGTERM drains."""

import shutil
import signal
import socket
import time

import grpc
import pytest
from xserv.v1 import engine_pb2

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
    engine = EngineProcess("--max-num-seqs", "1", "--max-queued-requests", "1", "--drain-grace", "1",
                           log_path=log_path)
    try:
        # Listening before the model is loaded: readiness is visible, calls are refused.
        assert first_health_answer(engine) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as error:
            list(engine.generate(max_tokens=2))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        engine.wait_serving()

        running = engine.generate(max_tokens=480, ignore_eos=True)
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

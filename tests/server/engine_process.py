"""Starts the real `xserv engine` process on a free loopback port and waits until it serves."""

import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xserv.v1 import engine_pb2, engine_pb2_grpc

from tests.support.processes import REPO, free_port

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
# A small cache and context keep the demo engine light on a shared CPU box.
SMALL = ("--num-kv-blocks", "256", "--max-model-len", "512", "--log-level", "warning")


class EngineProcess:
    def __init__(self, *flags: str, log_path: Path, port: int | None = None):
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xserv_cli", "engine", "--port", str(self.port), *SMALL, *flags],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def health_status(self, service: str = "") -> str:
        response = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_serving(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"xserv engine exited with {self.proc.returncode}: {self.log_text()}")
            try:
                if self.health_status() == "SERVING":
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"xserv engine not SERVING after {timeout} s: {self.log_text()}")

    def generate(self, timeout: float = 60, request_id: str = "", **params):
        """Streams a greedy continuation of "Hello" unless told otherwise."""
        text = params.pop("text", "Hello")
        params.setdefault("temperature", 0.0)
        request = engine_pb2.GenerateRequest(request_id=request_id, text=text,
                                             params=engine_pb2.SamplingParams(**params))
        return self.stub.Generate(request, timeout=timeout)

    def model_info(self) -> engine_pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)

    def wait_all_blocks_free(self, timeout: float = 2.0) -> engine_pb2.GetModelInfoResponse:
        deadline = time.monotonic() + timeout
        while True:
            info = self.model_info()
            if info.kv_blocks_free == info.kv_blocks_total or time.monotonic() > deadline:
                return info
            time.sleep(0.05)

    def log_text(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text()[-3000:]

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a graceful drain) and wait for the exit code; kill if it hangs."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()


def start_engine(tmp_path_factory, *flags: str) -> EngineProcess:
    engine = EngineProcess(*flags, log_path=tmp_path_factory.mktemp("engine") / "engine.log")
    try:
        engine.wait_serving()
    except Exception:
        engine.stop()
        raise
    return engine


@contextmanager
def started_engines(count: int, *flags: str, logs: Path):
    """`count` engines with FLAGS, each SERVING, stopped when the block ends (their logs in `logs`)."""
    started = [EngineProcess(*flags, log_path=logs / f"engine{i}.log") for i in range(count)]
    try:
        for engine in started:
            engine.wait_serving()
        yield started
    finally:
        for engine in started:
            engine.stop()

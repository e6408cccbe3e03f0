"""The real processes the reliability tests run: `xserv up`, or `xserv rest` in front of an
`xserv engine` the test controls; plus what the tests read from them (SSE, RSS, process trees)."""

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import requests
from xserv.v1 import engine_pb2, engine_pb2_grpc

from tests.support.processes import REPO, free_port, stop_process, wait_http_ok
from rest.test_up_e2e import alive, child_pids

__all__ = ["UpProcess", "RestProcess", "running_up", "completion", "free_port", "alive", "child_pids", "rss_mb", "stream_events",
           "wait_blocks_free"]


class UpProcess:
    """`xserv up` on free loopback ports, its output in a log file."""

    def __init__(self, log_path: Path, *flags: str):
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xserv_cli", "up", "--port", str(self.port),
             "--grpc-port", str(self.grpc_port), *flags],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.engine = engine_pb2_grpc.EngineServiceStub(self.channel)

    def wait_ready(self, timeout_s: float = 300) -> None:
        wait_http_ok(f"{self.url}/health", self.proc, timeout_s)

    def engine_pid(self) -> int:
        return next(pid for pid in child_pids(self.proc.pid) if " engine " in _cmdline(pid))

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.channel.close()
        stop_process(self.proc)
        self._log.close()


@contextlib.contextmanager
def running_up(log_path: Path, *flags: str):
    """A ready `xserv up` on the demo model with a small cache and one front worker."""
    process = UpProcess(log_path, "--workers", "1", "--threads", "32", "--num-kv-blocks", "256",
                        "--max-model-len", "512", *flags)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def completion(url: str, timeout: float = 120, **fields) -> requests.Response:
    """POST /v1/completions: a sampled continuation of 16 tokens unless told otherwise."""
    body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, **fields}
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout, stream=fields.get("stream", False))


class RestProcess:
    """`xserv rest` alone, in front of the engine(s) at `engine`."""

    def __init__(self, engine: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xserv_cli", "rest", "--engine", engine, "--port", str(self.port),
             "--log-level", "warning", *flags], cwd=REPO)

    def stop(self) -> None:
        stop_process(self.proc)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return " " + f.read().replace(b"\0", b" ").decode() + " "


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def stream_events(response: requests.Response):
    """The JSON payloads of an SSE response, then the string "[DONE]" if it came."""
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)


def wait_blocks_free(engine: engine_pb2_grpc.EngineServiceStub, timeout_s: float,
                     metadata=None) -> engine_pb2.GetModelInfoResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        info = engine.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5, metadata=metadata)
        if (info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)

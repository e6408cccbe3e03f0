"""Helpers for tests that start real processes: free loopback ports, readiness, clean stops, and
`xserv up` / `xserv rest` served for the length of a `with` block."""

import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import requests

REPO = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http_ok(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"process exited with {process.returncode}"
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):  # not listening yet, or a worker still booting
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Served:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT, the REST front
    grpc_address: str | None  # 127.0.0.1:PORT of the engine `xserv up` started; None for `xserv rest`

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextmanager
def served(command: str, *flags: str, timeout_s: float = 300, **popen) -> Iterator[Served]:
    """`xserv COMMAND` ("up" or "rest") with FLAGS, run from the repository on free loopback
    ports; yields once its /health answers 200, and stops it when the block ends. `popen` goes to
    subprocess.Popen (stdout, env, ...)."""
    port = free_port()
    ports = ["--port", str(port)]
    grpc_address = None
    if command == "up":
        grpc_address = f"127.0.0.1:{free_port()}"
        ports += ["--grpc-port", grpc_address.rsplit(":", 1)[1]]
    process = subprocess.Popen([sys.executable, "-m", "xserv_cli", command, *ports, *flags], cwd=REPO, **popen)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", process, timeout_s)
        yield Served(process, url, grpc_address)
    finally:
        stop_process(process)

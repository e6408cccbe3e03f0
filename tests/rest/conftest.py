"""Fixtures for the REST front's tests: a fake gRPC engine, the app in-process, and the app
under a real gunicorn (`xserv rest`) on free loopback ports."""

import os
import socket
import subprocess
import sys
import time

import falcon.testing
import pytest
import requests

from .fake_grpc_engine import FakeEngineServer
from xserv_rest.app import create_app
from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        except requests.ConnectionError:
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


@pytest.fixture(scope="module")
def fake():
    server = FakeEngineServer()
    yield server
    server.stop()


def make_client(fake: FakeEngineServer, **options) -> falcon.testing.TestClient:
    config = RestConfig(engines=(fake.address,), **options)
    return falcon.testing.TestClient(create_app(config, EngineClient.from_config(config)))


@pytest.fixture(scope="module")
def client(fake):
    return make_client(fake)


@pytest.fixture(scope="module")
def front(fake):
    """`xserv rest` under gunicorn in front of the fake engine; yields its base URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "xserv_engine.cli", "rest", "--engine", fake.address, "--port", str(port),
         "--workers", "1", "--threads", "48", "--max-body-bytes", "65536", "--log-level", "warning"],
        cwd=REPO)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", process, timeout_s=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(process)

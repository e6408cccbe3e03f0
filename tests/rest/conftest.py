"""Fixtures for the REST front's tests: a fake gRPC engine, the app in-process, and the app
under a real gunicorn (`xserv rest`) on free loopback ports."""

import falcon.testing
import pytest

from tests.support.processes import served
from xserv_rest.app import create_app
from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient

from .fake_grpc_engine import FakeEngineServer


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
def front(fake, tmp_path_factory):
    """`xserv rest` under gunicorn in front of the fake engine; yields its base URL."""
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    with served("rest", "--engine", fake.address, "--workers", "1", "--threads", "48", "--max-body-bytes", "65536",
                "--responses-store", str(store), "--log-level", "warning", timeout_s=30) as front:
        yield front.url

"""TLS and mTLS on the engine's gRPC port (`--grpc-tls-cert/--grpc-tls-key`, `--grpc-tls-client-ca`):
a client without the right certificate is refused; gRPC clients and `xserv rest` with it work.
Both services on the port (xserv.v1 and SMG's worker service) are behind the same TLS."""

import subprocess
import sys
import time

import grpc
import pytest
import requests
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from xserv.v1 import engine_pb2, engine_pb2_grpc

from tests.scaleout.certs import Authority
from tests.server.engine_process import SMALL
from tests.server.fake_engine import FakeEngine
from tests.server.harness import ServerThread
from tests.support.processes import REPO, free_port, stop_process, wait_http_ok
from xserv_engine.server.serve import EngineServer
from xserv_engine.server.tls import tls_from_args


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, stranger = Authority(directory, "ca"), Authority(directory, "stranger-ca")
    return {"ca": ca.pem.cert, "server": ca.issue("server", server=True), "client": ca.issue("client", server=False),
            "stranger_ca": stranger.pem.cert, "stranger_client": stranger.issue("stranger-client", server=False)}


class TlsServerThread(ServerThread):
    def __init__(self, tls):
        self._tls = tls
        super().__init__()

    async def _start(self) -> EngineServer:
        server = EngineServer("127.0.0.1", 0, None, self._tls)
        await server.start()
        return server


def serve_tls(pki, client_ca: bool) -> TlsServerThread:
    server = TlsServerThread(tls_from_args(str(pki["server"].cert), str(pki["server"].key),
                                           str(pki["ca"]) if client_ca else None))
    server.load(FakeEngine())
    return server


def credentials(pki, ca="ca", client: str | None = "client") -> grpc.ChannelCredentials:
    pem = pki[client] if client else None
    return grpc.ssl_channel_credentials(root_certificates=pki[ca].read_bytes(),
                                        private_key=pem.key.read_bytes() if pem else None,
                                        certificate_chain=pem.cert.read_bytes() if pem else None)


def calls_pass(channel: grpc.Channel) -> bool:
    """A Generate on xserv.v1 and a HealthCheck on SMG's service; False if the channel is refused."""
    try:
        request = engine_pb2.GenerateRequest(text="hi", params=engine_pb2.SamplingParams(max_tokens=2))
        generated = list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=10))
        healthy = pb_grpc.VllmEngineStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error  # the handshake failed
        return False
    finally:
        channel.close()
    return len(generated) == 2 and healthy


def test_mtls_serves_only_clients_with_a_certificate_from_its_ca(pki):
    server = serve_tls(pki, client_ca=True)
    address = f"localhost:{server.server.port}"
    try:
        assert calls_pass(grpc.secure_channel(address, credentials(pki)))
        assert not calls_pass(grpc.insecure_channel(address))
        assert not calls_pass(grpc.secure_channel(address, credentials(pki, client=None)))
        assert not calls_pass(grpc.secure_channel(address, credentials(pki, client="stranger_client")))
    finally:
        server.close()


def test_tls_alone_serves_any_client_that_trusts_the_engine(pki):
    server = serve_tls(pki, client_ca=False)
    address = f"127.0.0.1:{server.server.port}"
    try:
        assert calls_pass(grpc.secure_channel(address, credentials(pki, client=None)))
        assert not calls_pass(grpc.secure_channel(address, credentials(pki, ca="stranger_ca", client=None)))
        assert not calls_pass(grpc.insecure_channel(address))
    finally:
        server.close()


def test_tls_flags_are_checked_before_the_engine_starts(pki, tmp_path):
    with pytest.raises(ValueError):
        tls_from_args(str(pki["server"].cert), None, None)
    with pytest.raises(ValueError):
        tls_from_args(None, None, str(pki["ca"]))
    with pytest.raises(OSError):
        tls_from_args(str(tmp_path / "missing.crt"), str(pki["server"].key), None)


def first_answer(url: str, process: subprocess.Popen, timeout_s: float = 120) -> requests.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            return requests.get(url, timeout=30)
        except requests.ConnectionError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} never answered")


@pytest.mark.e2e
def test_xserv_rest_reaches_an_mtls_engine_with_its_client_certificate(pki, tmp_path):
    """A real engine process with mTLS, and two real `xserv rest` fronts: the one with the CA and a
    client certificate answers a chat; the one with the CA alone cannot reach the engine."""
    port = free_port()
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("engine", "front", "bare")}
    engine = subprocess.Popen(
        [sys.executable, "-m", "xserv_cli", "engine", "--port", str(port), *SMALL,
         "--grpc-tls-cert", str(pki["server"].cert), "--grpc-tls-key", str(pki["server"].key),
         "--grpc-tls-client-ca", str(pki["ca"])], cwd=REPO, stdout=logs["engine"], stderr=subprocess.STDOUT)
    fronts = {}
    try:
        for name, client in (("front", ["--engine-tls-cert", str(pki["client"].cert), "--engine-tls-key",
                                        str(pki["client"].key)]), ("bare", [])):
            http = free_port()
            fronts[name] = (http, subprocess.Popen(
                [sys.executable, "-m", "xserv_cli", "rest", "--engine", f"localhost:{port}",
                 "--port", str(http), "--workers", "1", "--threads", "4", "--engine-tls-ca", str(pki["ca"]), *client],
                cwd=REPO, stdout=logs[name], stderr=subprocess.STDOUT))
        http, front = fronts["front"]
        wait_http_ok(f"http://127.0.0.1:{http}/health", front, timeout_s=240)
        answer = requests.post(f"http://127.0.0.1:{http}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).json()
        assert answer["usage"]["completion_tokens"] == 4
        bare_port, bare = fronts["bare"]
        assert first_answer(f"http://127.0.0.1:{bare_port}/health", bare).status_code == 503
    finally:
        for _, process in fronts.values():
            stop_process(process)
        stop_process(engine)
        for log in logs.values():
            log.close()

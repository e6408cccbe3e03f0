"""`--grpc-token`: EngineService needs `authorization: Bearer <token>`; health and reflection stay open."""

import subprocess

import grpc
import pytest
from xserv.v1 import engine_pb2

from xserv_engine.server.auth import read_token

from .engine_process import GRPCURL
from .fake_engine import FakeEngine
from .harness import ServerThread

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def served():
    server = ServerThread(token=TOKEN)
    server.load(FakeEngine())
    yield server
    server.close()


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def generate(server, metadata=None) -> list:
    request = engine_pb2.GenerateRequest(text="hi", params=engine_pb2.SamplingParams(max_tokens=2))
    return list(server.stub.Generate(request, timeout=10, metadata=metadata))


@pytest.mark.parametrize("metadata", [None, bearer("wrong"), bearer(TOKEN + "x"), (("authorization", TOKEN),)],
                         ids=["none", "wrong", "longer", "no-bearer"])
def test_calls_without_the_right_token_are_unauthenticated(served, metadata):
    with pytest.raises(grpc.RpcError) as info:
        generate(served, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == "missing or invalid token"
    with pytest.raises(grpc.RpcError) as info:
        served.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_right_token_works(served):
    messages = generate(served, bearer(TOKEN))
    assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    info = served.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5, metadata=bearer(TOKEN))
    assert info.kv_blocks_total > 0


def test_health_and_reflection_need_no_token(served):
    assert served.health_status() == "SERVING"
    listed = subprocess.run([GRPCURL, "-plaintext", f"127.0.0.1:{served.server.port}", "list"],
                            capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert "xserv.v1.EngineService" in listed.stdout.split()


def test_token_file_first_line_is_the_token(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")
    assert read_token(None, str(path)) == TOKEN
    assert read_token("inline", None) == "inline" and read_token(None, None) is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(None, str(path))

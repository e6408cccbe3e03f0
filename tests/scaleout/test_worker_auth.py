"""`--grpc-token` guards SMG's worker service as it guards xserv.v1: both can generate. (SMG
itself sends no token: an engine behind SMG is protected by its network or mTLS, see
docs/scale-out.md.)"""

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from tests.server.fake_engine import FakeEngine
from tests.server.harness import ServerThread

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def worker():
    server = ServerThread(token=TOKEN)
    server.load(FakeEngine())
    yield pb_grpc.VllmEngineStub(server.channel)
    server.close()


def test_smg_worker_calls_without_the_token_are_unauthenticated(worker):
    for call in (lambda: worker.HealthCheck(pb.HealthCheckRequest(), timeout=5),
                 lambda: list(worker.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1])), timeout=5))):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_smg_worker_calls_with_the_token_pass(worker):
    reply = worker.HealthCheck(pb.HealthCheckRequest(), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert reply.healthy

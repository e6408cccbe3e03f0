"""One table of user-caused failures (tests/support/error_cases.py), each run over gRPC and, where
it has a route, over REST, against the fake engine of the REST tests and against real engines of
the demo model (in-process, one per runner kind): both must refuse alike."""

import falcon.testing
import grpc
import pytest
from xserv.v1 import engine_pb2_grpc

from tests.server.harness import ServerThread
from tests.support.error_cases import ERROR_CASES, ErrorCase
from tests.support.grpc_errors import bad_fields
from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_rest.app import create_app
from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient

from .fake_grpc_engine import MAX_MODEL_LEN

RUNNERS = ("generate", "pooling", "score")


@pytest.fixture(scope="module")
def real_addresses(demo_dir):
    """runner -> the address of a real engine of that kind on the demo model."""
    servers = {}
    try:
        for runner in RUNNERS:
            server = ServerThread()
            config = EngineConfig(model=str(demo_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                                  num_kv_blocks=260, runner=runner, enable_lora=runner == "generate")
            server.load(EngineThread(LLMEngine(config, progress=False)))
            servers[runner] = server
        yield {runner: f"127.0.0.1:{server.server.port}" for runner, server in servers.items()}
    finally:
        for server in servers.values():
            server.close()


@pytest.fixture(scope="module", params=["fake", "real"])
def engines(request, fake):
    """runner -> (gRPC stub, REST test client) of the engine behind it."""
    addresses = ({runner: fake.address for runner in RUNNERS} if request.param == "fake"
                 else request.getfixturevalue("real_addresses"))
    served = {}
    for runner, address in addresses.items():
        channel = grpc.insecure_channel(address)
        config = RestConfig(engines=(address,))
        served[runner] = (engine_pb2_grpc.EngineServiceStub(channel),
                          falcon.testing.TestClient(create_app(config, EngineClient.from_config(config))))
    yield served


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda case: case.id)
def test_the_engine_refuses_with_the_status_and_field(engines, case: ErrorCase):
    stub, _ = engines[case.runner]
    call = getattr(stub, case.rpc)
    with pytest.raises(grpc.RpcError) as raised:
        answer = call(case.request, timeout=60)
        if case.rpc == "Generate":
            list(answer)
    assert raised.value.code() == case.code, raised.value.details()
    assert case.says in raised.value.details()
    fields = [field for field, _ in bad_fields(raised.value)]
    assert fields == ([case.field] if case.field else []), fields


@pytest.mark.parametrize("case", [case for case in ERROR_CASES if case.rest], ids=lambda case: case.id)
def test_a_rest_client_gets_the_openai_error(engines, case: ErrorCase):
    _, client = engines[case.runner]
    resp = client.simulate_post(case.rest.path, json=case.rest.body)
    error = resp.json["error"]
    assert resp.status_code == case.rest.status, error
    assert (error["param"], error["code"]) == (case.rest.param, case.rest.code), error

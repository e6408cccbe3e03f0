"""The front's gRPC client: targets for several engines and round-robin balancing across them."""

import time

from .fake_grpc_engine import MODEL_ID, FakeEngineServer
from xserv.v1 import engine_pb2
from xserv_rest.engine_client import EngineClient, grpc_target


def test_targets():
    assert grpc_target(("localhost:50051",)) == "localhost:50051"
    assert grpc_target(("127.0.0.1:1", "localhost:2")) == "ipv4:127.0.0.1:1,127.0.0.1:2"


def test_requests_are_balanced_round_robin_over_engines():
    servers = [FakeEngineServer(), FakeEngineServer()]
    client = EngineClient(tuple(s.address for s in servers))
    try:
        assert client.is_serving()
        # round_robin spreads calls over the engines it is connected to, and is_serving() means
        # one: until the other's connection is up (milliseconds), calls all go to the first
        deadline = time.monotonic() + 10
        while not all(s.engine.requests for s in servers) and time.monotonic() < deadline:
            list(client.generate(engine_pb2.GenerateRequest(request_id="warm", text="hi")))
        before = [len(s.engine.requests) for s in servers]
        for i in range(6):
            list(client.generate(engine_pb2.GenerateRequest(request_id=f"rr-{i}", text="hi")))
        assert [len(s.engine.requests) - n for s, n in zip(servers, before)] == [3, 3]
    finally:
        client.close()
        for server in servers:
            server.stop()


def test_a_new_client_is_answered_at_once_by_an_engine_on_a_reused_port():
    """Another client in the process still backs off from the engine that left the port; the
    new client's first call does not wait that out (gRPC's shared pool made it UNAVAILABLE)."""
    gone = FakeEngineServer()
    old = EngineClient((gone.address,))
    assert old.is_serving()
    gone.stop()
    assert not old.is_serving()  # refused: its reconnect backoff (0.5 s) has begun
    back = FakeEngineServer(port=gone.port)
    new = EngineClient((back.address,))
    try:
        assert new.model_info().model_id == MODEL_ID
    finally:
        new.close()
        old.close()
        back.stop()

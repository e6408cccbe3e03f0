"""`priority` (vLLM's extra: an integer, lower first) on chat, completions and responses reaches
the engine's GenerateRequest; a value that is no 32-bit integer is a 400 naming it."""

import pytest

from .fake_grpc_engine import MODEL_ID

BODIES = {
    "/v1/chat/completions": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL_ID, "prompt": ["one", "two"]},
    "/v1/responses": {"model": MODEL_ID, "input": "hi", "store": False},
}


@pytest.mark.parametrize("path", BODIES)
def test_priority_reaches_every_engine_call(client, fake, path):
    before = len(fake.engine.requests)
    resp = client.simulate_post(path, json=dict(BODIES[path], priority=-7))
    assert resp.status_code == 200, resp.text
    calls = fake.engine.requests[before:]
    assert calls and all(call.priority == -7 for call in calls)


def test_without_priority_the_engine_gets_zero(client, fake):
    assert client.simulate_post("/v1/chat/completions", json=BODIES["/v1/chat/completions"]).status_code == 200
    assert fake.engine.requests[-1].priority == 0


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("priority", ["1", 1.5, 2**31])
def test_a_priority_that_is_no_int32_is_400_naming_it(client, path, priority):
    resp = client.simulate_post(path, json=dict(BODIES[path], priority=priority))
    assert resp.status_code == 400 and resp.json["error"]["param"] == "priority"

"""LoRA adapters through the REST front, in-process against the fake engine: a request's "model"
selects an adapter (GenerateRequest.lora_name) and the answer carries its name, /v1/models lists
the adapters after the base model, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
load and unload them; every error in OpenAI's format."""

import json

import pytest

from .conftest import make_client
from .fake_grpc_engine import MODEL_ID
from .test_errors import error_of

GENERATION_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]


@pytest.fixture(autouse=True)
def no_adapters(fake):
    """Each test starts with LoRA enabled and no adapter loaded."""
    yield
    fake.engine.adapters.clear()
    fake.engine.lora_enabled = True


@pytest.fixture
def client(fake):
    """A front of its own per test: nothing cached from another test's adapters."""
    return make_client(fake)


def load(client, name: str, path: str = "/adapters/sql", **headers):
    return client.simulate_post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=headers)


def body(path: str, model: str | None, stream: bool = False, prompt: str = "hi") -> dict:
    fields = {"stream": stream} | ({"model": model} if model is not None else {})
    if path == "/v1/chat/completions":
        return fields | {"messages": [{"role": "user", "content": prompt}]}
    if path == "/v1/completions":
        return fields | {"prompt": prompt}
    return fields | {"input": prompt}


def models_in(resp) -> set[str]:
    """The "model" of a JSON answer, or of every chunk or event (and response) of a stream."""
    assert resp.status_code == 200, resp.text
    if not resp.headers["content-type"].startswith("text/event-stream"):
        return {resp.json["model"]}
    events = [json.loads(line[len("data: "):]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return {event["response"]["model"] if "response" in event else event["model"] for event in events
            if "response" in event or "model" in event}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_model_selects_the_adapter_and_the_answer_names_it(client, fake, path, stream):
    assert load(client, "sql").status_code == 200
    assert models_in(client.simulate_post(path, json=body(path, "sql", stream))) == {"sql"}
    assert fake.engine.requests[-1].lora_name == "sql"
    for base in (MODEL_ID, None):
        assert models_in(client.simulate_post(path, json=body(path, base, stream))) == {MODEL_ID}
        assert fake.engine.requests[-1].lora_name == ""


def test_every_prompt_of_a_completions_batch_uses_the_adapter(client, fake):
    load(client, "sql")
    resp = client.simulate_post("/v1/completions", json={"model": "sql", "prompt": ["a", "b", "c"]})
    assert resp.json["model"] == "sql" and len(resp.json["choices"]) == 3
    assert [request.lora_name for request in fake.engine.requests[-3:]] == ["sql"] * 3


def test_an_unknown_model_is_404_after_asking_the_engine_once_more(client, fake):
    client.simulate_post("/v1/chat/completions", json=body("/v1/chat/completions", MODEL_ID))  # fills the cache
    calls, generated = fake.engine.model_info_calls, len(fake.engine.requests)
    for path in GENERATION_PATHS:
        error = error_of(client.simulate_post(path, json=body(path, "gpt-4")), 404)
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert "gpt-4" in error["message"] and "LoRA adapters" in error["message"]
    assert fake.engine.model_info_calls == calls + len(GENERATION_PATHS)
    assert len(fake.engine.requests) == generated  # the engine was never asked to generate


def test_without_lora_an_unknown_model_is_404_at_once(client, fake):
    fake.engine.lora_enabled = False
    client.simulate_post("/v1/completions", json=body("/v1/completions", None))
    calls = fake.engine.model_info_calls
    error = error_of(client.simulate_post("/v1/completions", json=body("/v1/completions", "gpt-4")), 404)
    assert error["code"] == "model_not_found" and "LoRA" not in error["message"]
    assert fake.engine.model_info_calls == calls


def test_an_adapter_loaded_after_the_cache_was_filled_is_found(client, fake):
    """Another front (or gunicorn worker) loaded it: this one's cached model info lacks it."""
    client.simulate_post("/v1/chat/completions", json=body("/v1/chat/completions", None))
    load(make_client(fake), "late", "/adapters/late")
    resp = client.simulate_post("/v1/chat/completions", json=body("/v1/chat/completions", "late"))
    assert models_in(resp) == {"late"} and fake.engine.requests[-1].lora_name == "late"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_an_adapter_unloaded_meanwhile_is_404(client, fake, path, stream):
    """The front's cache still lists it; the engine's NOT_FOUND becomes the same 404."""
    load(client, "gone")
    client.simulate_post(path, json=body(path, "gone"))  # cached with "gone" in it
    del fake.engine.adapters["gone"]
    error = error_of(client.simulate_post(path, json=body(path, "gone", stream)), 404)
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "gone" in error["message"]
    assert fake.engine.requests[-1].lora_name == "gone"


def test_models_lists_the_base_model_then_the_adapters(client, fake):
    load(client, "sql", "/adapters/sql")
    load(client, "chat", "/adapters/chat")
    cards = client.simulate_get("/v1/models").json["data"]
    assert [card["id"] for card in cards] == [MODEL_ID, "sql", "chat"]
    assert cards[0]["parent"] is None and cards[0]["root"] == MODEL_ID
    assert {key: cards[1][key] for key in ("object", "owned_by", "root", "parent", "max_model_len")} == {
        "object": "model", "owned_by": "xserv", "root": "/adapters/sql", "parent": MODEL_ID, "max_model_len": 4096}
    assert client.simulate_get("/v1/models/chat").json == cards[2]
    client.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert [card["id"] for card in client.simulate_get("/v1/models").json["data"]] == [MODEL_ID, "chat"]
    error = error_of(client.simulate_get("/v1/models/sql"), 404)
    assert error["code"] == "model_not_found"


def test_load_and_unload_answer_vllm_s_text(client, fake):
    resp = load(client, "sql", "/adapters/sql")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert resp.text == "Success: LoRA adapter 'sql' added successfully."
    assert fake.engine.adapters["sql"].path == "/adapters/sql"
    resp = client.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 1})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'sql' removed successfully."
    assert fake.engine.adapters == {}


@pytest.mark.parametrize("path, fields, param, message", [
    ("/v1/load_lora_adapter", {"lora_path": "/a"}, "lora_name", "'lora_name' is required"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": ""}, "lora_path", "'lora_path' must not be empty"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": 7}, "lora_path", "'lora_path' must be a string"),
    ("/v1/unload_lora_adapter", {}, "lora_name", "'lora_name' is required"),
])
def test_bad_bodies_are_400_naming_the_field(client, fake, path, fields, param, message):
    error = error_of(client.simulate_post(path, json=fields), 400)
    assert error["param"] == param and error["message"].startswith(message)


def test_the_engine_s_refusals_name_the_field(client):
    error = error_of(load(client, "error:invalid"), 400)
    assert (error["param"], error["type"]) == ("lora_name", "invalid_request_error")
    assert error["message"] == "lora_name: cannot be loaded"
    error = error_of(load(client, "new", "/adapters/error:invalid"), 400)
    assert error["param"] == "lora_path"
    error = error_of(client.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "nobody"}), 404)
    assert (error["param"], error["code"]) == ("lora_name", "model_not_found") and "nobody" in error["message"]


def test_an_engine_without_lora_is_400_naming_the_flag(client, fake):
    fake.engine.lora_enabled = False
    for resp in (load(client, "sql"), client.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "sql"})):
        error = error_of(resp, 400)
        assert "--enable-lora" in error["message"] and error["type"] == "invalid_request_error"


def test_the_runtime_endpoints_need_the_api_key(fake):
    locked = make_client(fake, api_keys=("sesame",))
    error_of(load(locked, "sql"), 401)
    error_of(locked.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 401)
    assert fake.engine.adapters == {}
    assert load(locked, "sql", Authorization="Bearer sesame").status_code == 200


def test_tokenize_takes_an_adapter_s_name(client):
    """An adapter shares its base model's tokenizer (lm-evaluation-harness's remote tokenizer sends the model)."""
    load(client, "sql")
    resp = client.simulate_post("/tokenize", json={"model": "sql", "prompt": "hi"})
    assert resp.status_code == 200 and resp.json["tokens"] == [ord("h"), ord("i")]


def test_openapi_documents_the_runtime_endpoints(client):
    document = client.simulate_get("/openapi.json").json
    schemas = document["components"]["schemas"]
    load_path = document["paths"]["/v1/load_lora_adapter"]["post"]
    assert load_path["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/LoadLoraAdapterRequest")
    assert set(schemas["LoadLoraAdapterRequest"]["required"]) == {"lora_name", "lora_path"}
    assert "text/plain" in load_path["responses"]["200"]["content"]
    unload_path = document["paths"]["/v1/unload_lora_adapter"]["post"]
    assert schemas["UnloadLoraAdapterRequest"]["required"] == ["lora_name"] and "404" in unload_path["responses"]
    assert schemas["ModelCard"]["properties"]["parent"]["anyOf"] == [{"type": "string"}, {"type": "null"}]

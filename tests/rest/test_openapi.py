"""GET /openapi.json describes what the server really accepts: every documented example is
answered 200, and schemathesis, generating requests from the document against `xserv rest`
under gunicorn, finds no 5xx, no undocumented status and no error body outside OpenAI's format."""

import re

import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from hypothesis import HealthCheck, given, settings

from xserv_engine.sampling_params import BOUNDS
from xserv_rest.config import RestConfig
from xserv_rest.protocol.openapi import openapi_document
from xserv_rest.routes import ROUTES, openapi_paths


def test_the_document_is_served_and_follows_the_config(client):
    document = client.simulate_get("/openapi.json").json
    assert document["openapi"] == "3.1.0"
    assert list(document["paths"]) == openapi_paths()
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and nullable_bound(chat, "n") == (1, 16)
    assert "security" not in document
    secured = openapi_document(RestConfig(api_keys=("k",), max_n=4))
    assert secured["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    assert nullable_bound(secured["components"]["schemas"]["CompletionRequest"], "n") == (1, 4)
    assert "401" in secured["paths"]["/v1/chat/completions"]["post"]["responses"]
    embeddings = document["components"]["schemas"]["EmbeddingRequest"]
    assert embeddings["required"] == ["input"] and nullable_bound(embeddings, "dimensions") == (1, 64)
    rerank = document["components"]["schemas"]["RerankRequest"]
    assert rerank["required"] == ["query", "documents"] and rerank["properties"]["documents"]["maxItems"] == 2048
    assert document["paths"]["/v2/rerank"]["post"]["requestBody"] == document["paths"]["/rerank"]["post"]["requestBody"]


def test_every_route_of_the_table_is_served(client):
    """create_app mounts each route of routes.py with a responder for its suffix."""
    for route in ROUTES:
        path = route.path.replace(":path}", "}").format(model_id="org/name", response_id="resp_1",
                                                         conversation_id="conv_1", item_id="msg_1")
        resource, responders, _, template = client.app._router.find(path)
        assert template == route.path, path
        suffix = f"_{route.suffix}" if route.suffix else ""
        assert any(hasattr(resource, f"on_{method.lower()}{suffix}") for method in responders), route


def nullable_bound(schema: dict, name: str) -> tuple:
    """(minimum, maximum) of an optional number property: anyOf [the number, null]."""
    number, null = schema["properties"][name]["anyOf"]
    assert null == {"type": "null"}
    return number["minimum"], number["maximum"]


def test_sampling_bounds_in_the_document_are_the_engine_s():
    """One owner: the engine's BOUNDS, so the document, the front and the engine agree."""
    schemas = openapi_document(RestConfig())["components"]["schemas"]
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        for name in ("temperature", "min_p", "presence_penalty", "frequency_penalty", "top_k", "seed", "min_tokens"):
            assert nullable_bound(schemas[request], name) == (BOUNDS[name].low, BOUNDS[name].high), name
        top_p = schemas[request]["properties"]["top_p"]["anyOf"][0]
        assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (BOUNDS["top_p"].low, BOUNDS["top_p"].high)


def documented_examples() -> list:
    document = openapi_document(RestConfig())
    return [pytest.param(path, example["value"], id=f"{path}:{name}")
            for path, item in document["paths"].items() if "requestBody" in item.get("post", {})
            for name, example in item["post"]["requestBody"]["content"]["application/json"].get("examples", {}).items()]


@pytest.mark.parametrize("path, body", documented_examples())
def test_every_documented_example_is_accepted(client, path, body):
    resp = client.simulate_post(path, json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream" if body.get("stream") else "application/json")


def openai_error_format(ctx, response, case) -> None:
    """Every 4xx/5xx JSON body is {"error": {message, type, param, code}} with a message."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["type"], body


# schemathesis' own rejection statuses, and 413: a body past maxItems (2049 documents) may also be
# past the front's --max-body-bytes, and is refused for that first
REJECTED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
# schemathesis' positive_data_acceptance, but for the refusals a schema cannot state
# (accepted_if_valid: the engine's own 400s, as vLLM answers them)
CONFIG = {"checks": {"negative_data_rejection": {"expected-statuses": REJECTED},
                     "positive_data_acceptance": {"enabled": False}}}
ACCEPTED_REFUSALS = (401, 403, 404, 409, 429)  # what a valid request may still meet


# what a JSON schema cannot state: a token id past the model's vocabulary, min_tokens above the
# max_tokens of the same request (its default included), an image URL the server cannot load (its
# base64, its host, its file), and the engine's image rules (its limit, none in a system message)
BEYOND_THE_SCHEMA = re.compile(r"[\w.\[\]]+: (token id \d+ is out of range( \(vocab size \d+\))?"
                               r"|must be at most max_tokens \(\d+\), got \d+"
                               r"|at most \d+ image\(s\) per prompt .*|a system message cannot hold images.*)"
                               r"|'[\w.\[\]]+' cannot be used: .*", re.DOTALL)


def accepted_if_valid(ctx, response, case) -> None:
    """A schema-valid request is not refused as invalid, unless for what the schema cannot state."""
    if 400 <= response.status_code < 500 and response.status_code not in ACCEPTED_REFUSALS:
        error = response.json()["error"]
        assert BEYOND_THE_SCHEMA.fullmatch(error["message"]), (response.status_code, error)


def operations(front: str) -> list:
    loaded = schemathesis.openapi.from_url(front + "/openapi.json", config=SchemathesisConfig.from_dict(CONFIG))
    return [result.ok() for result in loaded.get_all_operations()]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda mode: mode.value)
def test_schemathesis_finds_nothing(front, mode):
    """Schema-valid requests are accepted and schema-invalid ones rejected with a 4xx, for every
    operation; 30 examples each, a few seconds in all."""
    for operation in operations(front):
        if mode == GenerationMode.NEGATIVE and (operation.method != "post" or not operation.body):
            continue  # GETs and a cancel take no input to get wrong
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            positive = [accepted_if_valid] if mode == GenerationMode.POSITIVE else []
            case.call_and_validate(additional_checks=[openai_error_format, *positive], timeout=10)

        check()

"""POST /rerank (/v1/rerank, /v2/rerank) and POST /score in front of the fake reranker: documents
ranked by relevance, top_n, return_documents, Cohere's object documents, the instruction passed
to the engine, and every error a user can cause, named in the body's own terms."""

import json
import socket
import struct
import time
from urllib.parse import urlparse

import pytest
import requests

from .conftest import make_client
from .fake_grpc_engine import MAX_MODEL_LEN, MODEL_ID, NOT_A_RERANKER, TEMPLATE_TOKENS, score_of, score_tokens
from .test_errors import error_of

RERANK_PATHS = ["/rerank", "/v1/rerank", "/v2/rerank"]
SCORE_PATHS = ["/score", "/v1/score"]
QUERY = "red apple pie"
DOCUMENTS = ["blue sky", "apple pie recipe", "Red Apple Pie", "the red car"]  # relevance 0, 2/3, 1, 1/3


def float32(value: float) -> float:
    """The value as the engine sends it (protobuf floats are float32)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def relevance(document: str, query: str = QUERY) -> float:
    return float32(score_of(query, document))


@pytest.fixture(scope="module")
def last_request(fake):
    return lambda: fake.engine.score_requests[-1]


@pytest.mark.parametrize("path", RERANK_PATHS)
def test_rerank_ranks_the_documents_most_relevant_first(client, last_request, path):
    resp = client.simulate_post(path, json={"model": MODEL_ID, "query": QUERY, "documents": DOCUMENTS})
    assert resp.status_code == 200, resp.text
    body = resp.json
    assert list(body) == ["id", "model", "usage", "results"]
    assert body["id"].startswith("rerank-") and body["model"] == MODEL_ID
    assert [result["index"] for result in body["results"]] == [2, 1, 3, 0]
    assert [result["relevance_score"] for result in body["results"]] == [1.0, relevance(DOCUMENTS[1]),
                                                                         relevance(DOCUMENTS[3]), 0.0]
    assert [result["document"] for result in body["results"]] == [{"text": DOCUMENTS[i]} for i in (2, 1, 3, 0)]
    assert body["usage"] == {"total_tokens": sum(score_tokens(QUERY, document) for document in DOCUMENTS)}
    request = last_request()
    assert (request.request_id, request.query, list(request.documents)) == (body["id"], QUERY, DOCUMENTS)
    assert not request.HasField("instruction")


def test_top_n_keeps_the_best(client):
    results = client.simulate_post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json["results"]
    assert [result["index"] for result in results] == [2, 1]
    more = client.simulate_post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 99}).json["results"]
    assert [result["index"] for result in more] == [2, 1, 3, 0]


def test_equal_scores_keep_the_documents_order(client):
    documents = ["pie", "nothing", "apple", "none", "pie"]
    results = client.simulate_post("/rerank", json={"query": "apple pie", "documents": documents}).json["results"]
    assert [result["index"] for result in results] == [0, 2, 4, 1, 3]


def test_return_documents_false_leaves_the_texts_out(client):
    body = {"query": QUERY, "documents": DOCUMENTS, "return_documents": False}
    results = client.simulate_post("/rerank", json=body).json["results"]
    assert results[0] == {"index": 2, "relevance_score": 1.0}
    assert all(set(result) == {"index", "relevance_score"} for result in results)


def test_cohere_s_object_documents(client, last_request):
    documents = [{"text": "apple pie recipe", "id": "doc-1"}, "Red Apple Pie", {"text": "blue sky"}]
    results = client.simulate_post("/v2/rerank", json={"query": QUERY, "documents": documents}).json["results"]
    assert list(last_request().documents) == ["apple pie recipe", "Red Apple Pie", "blue sky"]
    assert [(result["index"], result["document"]) for result in results] == [
        (1, {"text": "Red Apple Pie"}), (0, {"text": "apple pie recipe"}), (2, {"text": "blue sky"})]


@pytest.mark.parametrize("path, body", [
    ("/rerank", {"query": QUERY, "documents": ["apple pie"]}),
    ("/score", {"text_1": QUERY, "text_2": "apple pie"}),
])
def test_the_instruction_reaches_the_engine(client, last_request, path, body):
    instruction = "Given a recipe question, find the recipe"
    resp = client.simulate_post(path, json=dict(body, instruction=instruction))
    assert resp.status_code == 200, resp.text
    assert last_request().instruction == instruction
    usage = resp.json["usage"]
    assert usage["total_tokens"] == score_tokens(QUERY, "apple pie", instruction)


def test_the_http_request_id_reaches_the_engine(client, fake, last_request):
    resp = client.simulate_post("/rerank", json={"query": "q", "documents": ["d"]},
                                headers={"X-Request-Id": "trace-rerank"})
    assert resp.status_code == 200
    assert fake.engine.metadata[last_request().request_id]["x-request-id"] == "trace-rerank"


@pytest.mark.parametrize("path", SCORE_PATHS)
def test_score_answers_in_text_2_s_order(client, last_request, path):
    before = int(time.time())
    resp = client.simulate_post(path, json={"model": MODEL_ID, "text_1": QUERY, "text_2": DOCUMENTS})
    assert resp.status_code == 200, resp.text
    body = resp.json
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == MODEL_ID
    assert before <= body["created"] <= time.time()
    assert body["data"] == [{"index": i, "object": "score", "score": relevance(document)}
                            for i, document in enumerate(DOCUMENTS)]
    tokens = sum(score_tokens(QUERY, document) for document in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert (last_request().query, list(last_request().documents)) == (QUERY, DOCUMENTS)


def test_score_takes_one_string_or_a_list_of_one_query(client, last_request):
    one = client.simulate_post("/score", json={"text_1": [QUERY], "text_2": "apple pie recipe"}).json
    assert one["data"] == [{"index": 0, "object": "score", "score": relevance("apple pie recipe")}]
    assert (last_request().query, list(last_request().documents)) == (QUERY, ["apple pie recipe"])


@pytest.mark.e2e
def test_rerank_through_gunicorn(front, fake):
    body = {"model": MODEL_ID, "query": QUERY, "top_n": 3, "documents": [{"text": d} for d in DOCUMENTS]}
    resp = requests.post(front + "/v1/rerank", json=body, timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    results = resp.json()["results"]
    assert [(r["index"], r["document"]["text"]) for r in results] == [(i, DOCUMENTS[i]) for i in (2, 1, 3)]
    assert [r["relevance_score"] for r in results] == [relevance(DOCUMENTS[i]) for i in (2, 1, 3)]
    scores = requests.post(front + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS[:2]}, timeout=30).json()
    assert [item["score"] for item in scores["data"]] == [0.0, relevance(DOCUMENTS[1])]
    error = requests.post(front + "/rerank", json={"query": QUERY, "documents": ["ok", "x" * MAX_MODEL_LEN]},
                          timeout=30).json()["error"]
    assert (error["param"], error["code"]) == ("documents[1]", "context_length_exceeded")


@pytest.mark.parametrize("path, body, param, message", [
    ("/rerank", {"query": "", "documents": ["a"]}, "query", "'query' must not be empty"),
    ("/rerank", {"documents": ["a"]}, "query", "'query' is required"),
    ("/rerank", {"query": "q", "documents": []}, "documents", "'documents' must hold at least one document"),
    ("/rerank", {"query": "q", "documents": ["a"] * 2049}, "documents",
     "'documents' must hold at most 2048 documents, got 2049"),
    ("/rerank", {"query": "q", "documents": ["a", ""]}, "documents[1]", "'documents[1]' must not be empty"),
    ("/rerank", {"query": "q", "documents": ["a", {"text": ""}]}, "documents[1]", "'documents[1]' must not be empty"),
    ("/rerank", {"query": "q", "documents": ["a", 7]}, "documents[1]",
     "'documents[1]' must be a string or a {\"text\": string} object"),
    ("/rerank", {"query": "q", "documents": "a"}, "documents", "'documents' must be an array of strings or of"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n", "'top_n' must be greater than or equal to 1"),
    ("/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 8}, "max_tokens_per_doc",
     "'max_tokens_per_doc' is not supported"),
    ("/score", {"text_1": "", "text_2": "a"}, "text_1", "'text_1' must not be empty"),
    ("/score", {"text_1": [""], "text_2": "a"}, "text_1[0]", "'text_1[0]' must not be empty"),
    ("/score", {"text_1": ["q", "r"], "text_2": ["a", "b"]}, "text_1",
     "'text_1' must be one query (a string or an array of one string): pairwise scoring"),
    ("/score", {"text_1": "q", "text_2": []}, "text_2", "'text_2' must hold at least one document"),
    ("/score", {"text_1": "q", "text_2": ["a", ""]}, "text_2[1]", "'text_2[1]' must not be empty"),
    ("/score", {"text_1": "q", "text_2": ["a"] * 2049}, "text_2",
     "'text_2' must hold at most 2048 documents, got 2049"),
    ("/score", {"text_1": "q", "text_2": "a", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens",
     "'truncate_prompt_tokens' is not supported"),
])
def test_bodies_refused_before_the_engine(client, fake, path, body, param, message):
    before = len(fake.engine.score_requests)
    error = error_of(client.simulate_post(path, json=body), 400)
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(message)
    assert len(fake.engine.score_requests) == before


def test_2048_documents_are_accepted(client):
    assert len(client.simulate_post("/rerank", json={"query": "q", "documents": ["a"] * 2048}).json["results"]) == 2048


@pytest.mark.parametrize("path, body, param", [
    ("/rerank", {"query": "q", "documents": ["a", "b error:invalid"]}, "documents[1]"),
    ("/rerank", {"query": "q error:invalid", "documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "documents": ["a"], "instruction": "error:invalid"}, "instruction"),
    ("/score", {"text_1": "q", "text_2": ["a", "b error:invalid"]}, "text_2[1]"),
    ("/score", {"text_1": "q", "text_2": "b error:invalid"}, "text_2"),
    ("/score", {"text_1": "q error:invalid", "text_2": "a"}, "text_1"),
    ("/score", {"text_1": ["q error:invalid"], "text_2": "a"}, "text_1[0]"),
])
def test_engine_invalid_argument_names_the_body_s_field(client, path, body, param):
    error = error_of(client.simulate_post(path, json=body), 400)
    assert (error["param"], error["code"]) == (param, None)


@pytest.mark.parametrize("path, body, param", [
    ("/rerank", {"query": "q", "documents": ["ok", "x" * MAX_MODEL_LEN]}, "documents[1]"),
    ("/score", {"text_1": "q", "text_2": ["ok", "x" * MAX_MODEL_LEN]}, "text_2[1]"),
    ("/score", {"text_1": "q", "text_2": "x" * MAX_MODEL_LEN}, "text_2"),
])
def test_a_document_longer_than_the_context(client, path, body, param):
    error = error_of(client.simulate_post(path, json=body), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert f"{TEMPLATE_TOKENS + 1 + MAX_MODEL_LEN} tokens" in error["message"]
    assert str(MAX_MODEL_LEN) in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/rerank", {"query": "q error:wrong-runner", "documents": ["a"]}),
    ("/score", {"text_1": "q error:wrong-runner", "text_2": "a"}),
])
def test_an_engine_that_is_no_reranker_answers_400_on_model(client, path, body):
    error = error_of(client.simulate_post(path, json=body), 400)
    assert error == {"message": NOT_A_RERANKER, "type": "invalid_request_error", "param": "model", "code": None}


@pytest.mark.parametrize("path, body", [
    ("/v1/rerank", {"query": "q", "documents": ["a"], "model": "BAAI/bge-reranker-v2-m3"}),
    ("/v1/score", {"text_1": "q", "text_2": "a", "model": "BAAI/bge-reranker-v2-m3"}),
])
def test_another_model_is_404(client, fake, path, body):
    before = len(fake.engine.score_requests)
    error = error_of(client.simulate_post(path, json=body), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert len(fake.engine.score_requests) == before


def test_engine_overloaded_and_unavailable(client):
    resp = client.simulate_post("/rerank", json={"query": "q", "documents": ["a", "error:overloaded"]})
    assert error_of(resp, 429)["code"] == "engine_overloaded" and resp.headers["retry-after"] == "1"
    error = error_of(client.simulate_post("/score", json={"text_1": "q", "text_2": "error:unavailable"}), 503)
    assert error["code"] == "engine_unavailable"


def test_api_keys_guard_the_unversioned_paths_too(fake):
    locked = make_client(fake, api_keys=("sesame",))
    bodies = {"/rerank": {"query": "q", "documents": ["a"]}, "/v2/rerank": {"query": "q", "documents": ["a"]},
              "/score": {"text_1": "q", "text_2": "a"}}
    for path, body in bodies.items():
        assert error_of(locked.simulate_post(path, json=body), 401)["code"] == "invalid_api_key", path
        assert locked.simulate_post(path, json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_past_the_request_timeout_is_504_and_the_engine_call_ends(fake, last_request):
    hurried = make_client(fake, request_timeout_s=1.0)
    error = error_of(hurried.simulate_post("/rerank", json={"query": "q", "documents": ["slow"]}), 504)
    assert error["code"] == "request_timeout"
    assert fake.engine.wait_cancelled(last_request().request_id, timeout_s=2) is not None


@pytest.mark.e2e
def test_a_client_that_hangs_up_cancels_the_engine_call(front, fake, last_request):
    before = len(fake.engine.score_requests)
    url = urlparse(front)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    payload = json.dumps({"text_1": "q", "text_2": ["a", "slow"]}).encode()
    sock.sendall(f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.monotonic() + 5
    while len(fake.engine.score_requests) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    closed_at = time.monotonic()
    sock.close()
    cancelled_at = fake.engine.wait_cancelled(last_request().request_id, timeout_s=2)
    assert cancelled_at is not None and cancelled_at - closed_at < 2

"""End to end: `xserv up --model DIR --runner score` on a Qwen3 checkpoint (a reranker's shape),
used over HTTP as a RAG pipeline's reranking step would (vLLM's /v1/rerank and /score): the scores
are the ones Qwen3-Reranker's model card computes with transformers, ranked."""

import subprocess
import time

import pytest
import requests
import torch

from tests.engine.test_rerank import DOCUMENTS, QUERY, model_card_scores
from tests.support.processes import served

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def checkpoint(reranker_checkpoint):
    return reranker_checkpoint


@pytest.fixture(scope="module")
def up(checkpoint, tmp_path_factory):
    banner = tmp_path_factory.mktemp("up") / "stdout.txt"
    with open(banner, "w") as out, served("up", "--model", str(checkpoint[0]), "--runner", "score", "--workers", "1",
                                          "--num-kv-blocks", "64", "--max-model-len", "512", "--dtype", "float32",
                                          "--log-level", "warning", stdout=out) as up:
        yield up, banner


@pytest.fixture(scope="module")
def expected(checkpoint):
    from transformers import AutoTokenizer

    return model_card_scores(checkpoint[1], AutoTokenizer.from_pretrained(checkpoint[0]), QUERY, DOCUMENTS)


def test_rerank_ranks_by_the_model_cards_scores(up, expected):
    reply = requests.post(f"{up[0].url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2},
                          timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    ranked = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in results] == ranked
    for r in results:
        assert r["document"]["text"] == DOCUMENTS[r["index"]]
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
    assert reply.json()["usage"]["total_tokens"] > 3 * 40  # every document's prompt, the template included


def test_score_gives_each_pair_in_order(up, expected):
    reply = requests.post(f"{up[0].url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60)
    assert reply.status_code == 200, reply.text
    got = [d["score"] for d in reply.json()["data"]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-4)


def test_a_document_too_long_is_named(up):
    reply = requests.post(f"{up[0].url}/v1/rerank", json={"query": QUERY, "documents": ["short", "word " * 600]},
                          timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("documents[1]", "context_length_exceeded")


def test_the_banner_shows_a_rerank_request(up):
    banner = up[1]
    deadline = time.monotonic() + 10
    while "try:" not in banner.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in banner.read_text().splitlines() if "try:" in line)
    assert "/v1/rerank" in line
    out = subprocess.run(line.split("try: ", 1)[1], shell=True, capture_output=True, text=True, timeout=30, check=True)
    assert '"relevance_score"' in out.stdout

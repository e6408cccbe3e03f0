"""End to end: the real `xserv engine --runner score` process on a Qwen3 checkpoint (a reranker's
shape), spoken to with the real stubs and with grpcurl: Score gives the model card's P("yes")."""

import json
import subprocess

import grpc
import pytest
import torch
from xserv.v1 import engine_pb2

from tests.engine.test_rerank import DOCUMENTS, QUERY, model_card_scores
from tests.support.grpc_errors import bad_fields

from .engine_process import GRPCURL, start_engine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def checkpoint(reranker_checkpoint):
    return reranker_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory, checkpoint):
    process = start_engine(tmp_path_factory, "--model", str(checkpoint[0]), "--dtype", "float32", "--runner", "score")
    yield process
    assert process.stop() == 0


def score(engine, query, *documents, **fields) -> engine_pb2.ScoreResponse:
    request = engine_pb2.ScoreRequest(query=query, documents=documents, **fields)
    return engine.stub.Score(request, timeout=60)


def test_score_answers_every_document_in_order_as_the_model_card(engine, checkpoint):
    from transformers import AutoTokenizer

    assert engine.model_info().runner == "score"
    reply = score(engine, QUERY, *DOCUMENTS, request_id="rank-1")
    assert reply.request_id == "rank-1" and len(reply.scores) == len(DOCUMENTS)
    expected = model_card_scores(checkpoint[1], AutoTokenizer.from_pretrained(checkpoint[0]), QUERY, DOCUMENTS)
    torch.testing.assert_close(torch.tensor([s.score for s in reply.scores]), torch.tensor(expected), atol=1e-5,
                               rtol=1e-4)
    assert all(s.prompt_tokens > 40 for s in reply.scores)  # the template's tokens are counted
    info = engine.wait_all_blocks_free()
    assert info.kv_blocks_free == info.kv_blocks_total


@pytest.mark.parametrize("query, documents, fields, field", [
    ("", ("doc",), {}, "query"),
    ("q", (), {}, "documents"),
    ("q", ("doc", ""), {}, "documents[1]"),
    ("q", ("doc",), {"instruction": ""}, "instruction"),
    ("q", ("doc", "word " * 600), {}, "documents[1]"),
])
def test_bad_calls_name_the_field(engine, query, documents, fields, field):
    with pytest.raises(grpc.RpcError) as raised:
        score(engine, query, *documents, **fields)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_fields(raised.value)[0][0] == field


def test_generate_and_embed_on_a_reranker_say_what_it_serves(engine):
    with pytest.raises(grpc.RpcError) as raised:
        list(engine.generate(max_tokens=2))
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED and "relevance scores" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        engine.stub.Embed(engine_pb2.EmbedRequest(inputs=[engine_pb2.EmbedInput(text="Hi")]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED and "use Score" in raised.value.details()


def test_grpcurl_scores_with_reflection(engine):
    body = json.dumps({"query": QUERY, "documents": DOCUMENTS[:2]})
    out = subprocess.run([GRPCURL, "-plaintext", "-d", body, engine.address, "xserv.v1.EngineService/Score"],
                         capture_output=True, text=True, timeout=30, check=True)
    scores = json.loads(out.stdout)["scores"]
    assert len(scores) == 2 and all(0 <= s.get("score", 0) <= 1 for s in scores)

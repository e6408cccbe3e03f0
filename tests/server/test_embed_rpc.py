"""End to end: the real `xserv engine` process on a Qwen3-Embedding-layout checkpoint (the pooling
runner, chosen by its sentence-transformers modules.json), spoken to with the real stubs and with
grpcurl."""

import json
import re
import subprocess
import time

import grpc
import pytest
import torch
from xserv.v1 import engine_pb2

from tests.engine.test_embeddings import TEXTS, reference
from tests.support.grpc_errors import bad_fields

from .engine_process import GRPCURL, start_engine
from .test_engine_observability import logged, scrape

pytestmark = pytest.mark.e2e

CONTEXT = 512  # the engine's --max-model-len in these tests


@pytest.fixture(scope="module")
def checkpoint(embedding_checkpoint):
    return embedding_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory, checkpoint):
    process = start_engine(tmp_path_factory, "--model", str(checkpoint[0]), "--dtype", "float32",
                           "--metrics-port", "0", "--log-level", "info")
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", process.log_text()).group(1)
    process.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint[0])


def embed(engine, *inputs, timeout: float = 60, **fields) -> engine_pb2.EmbedResponse:
    pb_inputs = [engine_pb2.EmbedInput(text=x) if isinstance(x, str) else
                 engine_pb2.EmbedInput(token_ids=engine_pb2.TokenIds(ids=x)) for x in inputs]
    return engine.stub.Embed(engine_pb2.EmbedRequest(inputs=pb_inputs, **fields), timeout=timeout)


def test_embed_answers_every_input_in_order_as_transformers(engine, checkpoint, hf_tokenizer):
    info = engine.model_info()
    assert (info.runner, info.embedding_size) == ("pooling", 64)
    ids = hf_tokenizer(TEXTS[3])["input_ids"]
    reply = embed(engine, TEXTS[0], TEXTS[1], ids, request_id="batch")
    assert reply.request_id == "batch" and len(reply.embeddings) == 3
    for got, expected_ids in zip(reply.embeddings, [hf_tokenizer(TEXTS[0])["input_ids"],
                                                     hf_tokenizer(TEXTS[1])["input_ids"], ids]):
        assert got.prompt_tokens == len(expected_ids)
        torch.testing.assert_close(torch.tensor(list(got.values)), reference(checkpoint[1], expected_ids),
                                   atol=2e-5, rtol=1e-4)
    short = embed(engine, TEXTS[0], dimensions=8).embeddings[0]
    torch.testing.assert_close(torch.tensor(list(short.values)),
                               reference(checkpoint[1], hf_tokenizer(TEXTS[0])["input_ids"], dimensions=8),
                               atol=2e-5, rtol=1e-4)
    info = engine.wait_all_blocks_free()
    assert info.kv_blocks_free == info.kv_blocks_total


def test_a_call_larger_than_the_window_keeps_the_order(engine):
    texts = [f"document number {i}" for i in range(300)]  # more than EMBED_WINDOW in flight
    reply = embed(engine, *texts, *texts[:5])
    vectors = [list(e.values) for e in reply.embeddings]
    assert len(vectors) == 305
    assert vectors[300:] == vectors[:5]  # the same input, the same vector, wherever it sits
    assert len({tuple(v) for v in vectors[:300]}) == 300


@pytest.mark.parametrize("inputs, fields, field", [
    ((), {}, "inputs"),
    (("fine", ""), {}, "inputs[1].text"),
    (("fine", [5, 151936]), {}, "inputs[1].token_ids"),
    (("fine",), {"dimensions": 65}, "dimensions"),
])
def test_bad_calls_name_the_field(engine, inputs, fields, field):
    with pytest.raises(grpc.RpcError) as raised:
        embed(engine, *inputs, **fields)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_fields(raised.value)[0][0] == field


def test_an_input_longer_than_the_context_is_named(engine):
    with pytest.raises(grpc.RpcError) as raised:
        embed(engine, "short", "fine", "word " * (CONTEXT + 10))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_fields(raised.value)[0][0] == "inputs[2]"
    assert "maximum context length of 512" in raised.value.details()
    cut = embed(engine, "word " * (CONTEXT + 10), truncate_prompt_tokens=CONTEXT).embeddings[0]
    assert cut.prompt_tokens == CONTEXT
    info = engine.wait_all_blocks_free()
    assert info.kv_blocks_free == info.kv_blocks_total  # inputs 0 and 1 ran and were given back


def test_generate_on_an_embedding_engine_says_what_it_serves(engine):
    with pytest.raises(grpc.RpcError) as raised:
        list(engine.generate(max_tokens=4))
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "serves embeddings" in raised.value.details()


def test_a_deadline_ends_the_call_and_frees_its_blocks(engine):
    texts = [f"{i} " + "long document text " * 130 for i in range(1000)]  # ~400k tokens: seconds of work
    with pytest.raises(grpc.RpcError) as raised:
        embed(engine, *texts, timeout=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = engine.wait_all_blocks_free(timeout=10)
    assert info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0 and info.num_waiting == 0


def test_grpcurl_embeds_with_reflection(engine):
    body = json.dumps({"inputs": [{"text": "Hello"}], "dimensions": 4})
    out = subprocess.run([GRPCURL, "-plaintext", "-d", body, engine.address, "xserv.v1.EngineService/Embed"],
                         capture_output=True, text=True, timeout=30, check=True)
    reply = json.loads(out.stdout)
    assert len(reply["embeddings"][0]["values"]) == 4 and reply["embeddings"][0]["prompt_tokens"] == 2


def test_a_call_logs_one_line_and_counts_in_the_metrics(engine):
    before = scrape(engine).get('xserv_request_finished_total{finish_reason="stop"}', 0)
    embed(engine, "one", "two words", request_id="emb-log-1")
    assert logged(engine, "request_id=emb-log-1 ")
    line = next(x for x in engine.log_text().splitlines() if "request_id=emb-log-1 " in x)
    assert "status=OK finish_reason=stop,stop prompt_tokens=5 completion_tokens=0" in line  # 2 + 3 tokens
    deadline = time.monotonic() + 5
    while scrape(engine).get('xserv_request_finished_total{finish_reason="stop"}', 0) < before + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)

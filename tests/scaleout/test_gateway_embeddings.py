"""An embedding model past one machine: two real `xserv engine` processes on a Qwen3-Embedding-
layout checkpoint behind a real SGLang Model Gateway (`smg launch`, gRPC mode), which tokenizes
and sends each input to a worker's VllmEngine.Embed; spoken to with the openai SDK."""

import pytest
import torch
from openai import OpenAI
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from tests.engine.test_embeddings import TEXTS, reference
from tests.scaleout.gateway import Gateway
from tests.server.engine_process import started_engines

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def checkpoint(embedding_checkpoint):
    return embedding_checkpoint


@pytest.fixture(scope="module")
def engines(tmp_path_factory, checkpoint):
    flags = ("--model", str(checkpoint[0]), "--dtype", "float32")
    with started_engines(2, *flags, logs=tmp_path_factory.mktemp("engines")) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(engines, checkpoint, tmp_path_factory):
    smg = Gateway([e.address for e in engines], log_path=tmp_path_factory.mktemp("smg") / "smg.log")
    try:
        smg.wait_ready(checkpoint[0].name, workers=2)
        yield smg
    finally:
        smg.stop()


def test_workers_say_they_embed(engines):
    stub = pb_grpc.VllmEngineStub(engines[0].channel)
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).is_generation is False
    reply = stub.Embed(pb.EmbedRequest(request_id="w1", tokenized=pb.TokenizedInput(input_ids=[9707, 151643])),
                       timeout=10)
    assert reply.prompt_tokens == 2 and reply.embedding_dim == len(reply.embedding) == 64


def test_the_sdk_through_the_gateway_gets_transformers_vectors(gateway, checkpoint):
    """One input per request: SMG 1.13 answers a list of inputs with a single vector (measured by
    hand: 4 texts gave 1 embedding of 112 tokens), whatever the worker does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint[0])
    sdk = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for text in TEXTS:
        reply = sdk.embeddings.create(model=checkpoint[0].name, input=text, encoding_format="float")
        ids = tokenizer(text)["input_ids"]
        assert reply.usage.prompt_tokens == len(ids)  # SMG's tokenization appends <|endoftext|> too
        torch.testing.assert_close(torch.tensor(reply.data[0].embedding), reference(checkpoint[1], ids), atol=2e-5,
                                   rtol=1e-4)

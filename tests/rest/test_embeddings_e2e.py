"""End to end: `xserv up --model DIR` on a Qwen3-Embedding-layout checkpoint (the pooling runner,
chosen by its modules.json), used through the official openai SDK as a RAG pipeline would:
the vectors are the ones transformers computes with Qwen's recipe."""

import subprocess
import time

import openai
import pytest
import torch

from tests.engine.test_embeddings import TEXTS, reference
from tests.support.embedding_checkpoint import QUERY_PROMPT
from tests.support.processes import served

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def checkpoint(embedding_checkpoint):
    return embedding_checkpoint


@pytest.fixture(scope="module")
def up(checkpoint, tmp_path_factory):
    banner = tmp_path_factory.mktemp("up") / "stdout.txt"
    with open(banner, "w") as out, served("up", "--model", str(checkpoint[0]), "--workers", "1", "--num-kv-blocks",
                                          "64", "--max-model-len", "512", "--dtype", "float32", "--log-level",
                                          "warning", stdout=out) as up:
        yield up, banner


@pytest.fixture(scope="module")
def sdk(up):
    return openai.OpenAI(base_url=up[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint[0])


def test_the_sdk_gets_transformers_vectors(sdk, checkpoint, hf_tokenizer):
    model = sdk.models.list().data[0].id
    query = QUERY_PROMPT + "What is the capital of China?"
    reply = sdk.embeddings.create(model=model, input=[query, *TEXTS])  # the SDK asks for base64
    assert [d.index for d in reply.data] == list(range(len(TEXTS) + 1))
    expected_tokens = 0
    for text, data in zip([query, *TEXTS], reply.data):
        ids = hf_tokenizer(text)["input_ids"]
        expected_tokens += len(ids)
        torch.testing.assert_close(torch.tensor(data.embedding), reference(checkpoint[1], ids), atol=2e-5, rtol=1e-4)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected_tokens
    as_floats = sdk.embeddings.create(model=model, input=TEXTS[0], encoding_format="float", dimensions=32)
    assert len(as_floats.data[0].embedding) == 32
    torch.testing.assert_close(torch.tensor(as_floats.data[0].embedding),
                               reference(checkpoint[1], hf_tokenizer(TEXTS[0])["input_ids"], dimensions=32),
                               atol=2e-5, rtol=1e-4)


def test_errors_a_user_can_act_on(sdk):
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.embeddings.create(model=sdk.models.list().data[0].id, input=["fine", "word " * 600])
    assert raised.value.body["code"] == "context_length_exceeded" and raised.value.body["param"] == "input[1]"
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(model=sdk.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}])
    message = raised.value.body["message"]  # in a REST user's terms: what the model is, what to start instead
    assert "is an embedding model (/v1/embeddings)" in message and "xserv up --model DIR" in message
    assert raised.value.body["param"] == "model"


def test_the_banner_shows_an_embeddings_request(up):
    banner = up[1]
    deadline = time.monotonic() + 10
    while "try:" not in banner.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in banner.read_text().splitlines() if "try:" in line)
    assert "/v1/embeddings" in line
    out = subprocess.run(line.split("try: ", 1)[1], shell=True, capture_output=True, text=True, timeout=30, check=True)
    assert '"object":"embedding"' in out.stdout.replace(" ", "")

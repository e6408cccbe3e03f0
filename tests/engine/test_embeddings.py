"""Embedding models (the pooling runner): a Qwen3-Embedding-layout checkpoint gives, for every
input, the vector transformers' Qwen3Model gives with Qwen's own recipe (the tokenizer's
<|endoftext|> appended, the last token's final hidden state, L2-normalized) - batched,
chunked, from the prefix cache and truncated alike; what an embedding engine cannot do is
refused by name."""

import pytest
import torch
import torch.nn.functional as F

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from tests.support.embedding_checkpoint import ENDOFTEXT, QUERY_PROMPT, write_embedding_checkpoint
from xserv_engine.errors import InputTooLong, InvalidRequest, Unsupported
from xserv_engine.models.pooling import EmbedParams

TEXTS = [
    "The capital of China is Beijing.",
    QUERY_PROMPT + "What is the capital of China?",
    "Gravity is a force that attracts two bodies towards each other. " * 6,
    "你好，世界 🙂",
]


@pytest.fixture(scope="module")
def embedding_dir(embedding_checkpoint):
    return embedding_checkpoint


@pytest.fixture(scope="module")
def engine(embedding_dir):
    engine = make_engine(embedding_dir[0])
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_tokenizer(embedding_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedding_dir[0])


def reference(model, ids: list[int], dimensions: int | None = None, normalize: bool = True) -> torch.Tensor:
    """Qwen3-Embedding's published recipe: last_token_pool over transformers' hidden states."""
    with torch.no_grad():
        vector = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    vector = vector[:dimensions] if dimensions else vector
    return F.normalize(vector, dim=0) if normalize else vector


def embed_all(engine, inputs, **params) -> list:
    """Every input added before any finishes (so they share steps); their outputs in order."""
    collectors = [Collector() for _ in inputs]
    embed_all.counter += 1
    for i, (prompt, collector) in enumerate(zip(inputs, collectors)):
        engine.add_embed_request(f"emb-{embed_all.counter}-{i}", prompt, EmbedParams(**params), collector)
    return [collector.wait()[-1] for collector in collectors]


embed_all.counter = 0


def test_embeddings_equal_transformers_with_qwens_recipe(engine, embedding_dir, hf_tokenizer):
    model = embedding_dir[1]
    outputs = embed_all(engine, TEXTS)
    for text, out in zip(TEXTS, outputs):
        ids = hf_tokenizer(text)["input_ids"]
        assert ids[-1] == hf_tokenizer.convert_tokens_to_ids(ENDOFTEXT)  # the token the vector is read at
        assert out.finish_reason == "stop" and out.token_ids == ()
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
        got = torch.tensor(out.embedding)
        assert got.shape == (64,)
        torch.testing.assert_close(got, reference(model, ids), atol=2e-5, rtol=1e-4)
        assert abs(got.norm().item() - 1) < 1e-5
    vectors = torch.tensor([out.embedding for out in outputs])
    assert torch.linalg.matrix_rank(vectors) == len(TEXTS)  # four different inputs, four different vectors
    wait_idle(engine)


def test_token_ids_and_truncation(engine, embedding_dir, hf_tokenizer):
    model = embedding_dir[1]
    ids = hf_tokenizer(TEXTS[2])["input_ids"]
    as_text, as_ids, cut = embed_all(engine, [TEXTS[2], ids, TEXTS[2]], truncate_prompt_tokens=None)[:2] + \
        embed_all(engine, [TEXTS[2]], truncate_prompt_tokens=10)
    assert as_ids.embedding == as_text.embedding
    assert cut.usage.prompt_tokens == 10
    torch.testing.assert_close(torch.tensor(cut.embedding), reference(model, ids[-10:]), atol=2e-5, rtol=1e-4)
    assert cut.embedding != as_text.embedding


def test_dimensions_cut_then_normalize(engine, embedding_dir, hf_tokenizer):
    ids = hf_tokenizer(TEXTS[0])["input_ids"]
    (out,) = embed_all(engine, [TEXTS[0]], dimensions=16)
    assert len(out.embedding) == 16
    torch.testing.assert_close(torch.tensor(out.embedding), reference(embedding_dir[1], ids, dimensions=16),
                               atol=2e-5, rtol=1e-4)


def test_a_model_without_normalize_gives_the_raw_hidden_state(tmp_path, demo_dir, hf_tokenizer):
    model = write_embedding_checkpoint(tmp_path, demo_dir, normalize=False)
    engine = make_engine(tmp_path)
    try:
        (out,) = embed_all(engine, [TEXTS[1]])
        expected = reference(model, hf_tokenizer(TEXTS[1])["input_ids"], normalize=False)
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=1e-4, rtol=1e-4)
        assert abs(expected.norm().item() - 1) > 0.1  # so that normalizing anyway would fail this
    finally:
        engine.shutdown()


def test_chunked_prefill_and_prefix_cache_give_the_same_vector(embedding_dir):
    text = TEXTS[2] * 3  # ~130 tokens: 17 chunks of 8, then 8 cached blocks of 16 the second time
    engine = make_engine(embedding_dir[0], max_num_batched_tokens=8)
    whole = make_engine(embedding_dir[0], enable_prefix_caching=False)
    try:
        (chunked,) = embed_all(engine, [text])
        (again,) = embed_all(engine, [text])
        (plain,) = embed_all(whole, [text])
        assert chunked.usage.cached_prompt_tokens == 0 and again.usage.cached_prompt_tokens >= 112
        for out in (chunked, again):
            torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(plain.embedding), atol=2e-5, rtol=1e-4)
        wait_idle(engine)  # every block back
    finally:
        engine.shutdown()
        whole.shutdown()


def test_an_embedding_engine_reports_its_runner_and_refuses_generation(engine):
    info = engine.model_info()
    assert (info.runner, info.embedding_size) == ("pooling", 64)
    with pytest.raises(Unsupported, match="serves embeddings"):
        generate(engine, "Hello", max_tokens=4)


def test_a_generation_engine_refuses_embeddings(tied_model_dir):
    engine = make_engine(tied_model_dir)
    try:
        assert engine.model_info().runner == "generate"
        with pytest.raises(Unsupported, match="is a generation model"):
            engine.add_embed_request("e", "Hello", EmbedParams(), Collector())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prompt, params, error, field", [
    ("Hi", {"dimensions": 0}, InvalidRequest, "dimensions"),
    ("Hi", {"dimensions": 65}, InvalidRequest, "dimensions"),
    ("Hi", {"truncate_prompt_tokens": 0}, InvalidRequest, "truncate_prompt_tokens"),
    ("", {}, InvalidRequest, "inputs[3].text"),
    ([1, 151936], {}, InvalidRequest, "inputs[3].token_ids"),
    ("word " * 1100, {}, InputTooLong, "inputs[3]"),
])
def test_bad_inputs_are_refused_naming_the_field(engine, prompt, params, error, field):
    with pytest.raises(error) as raised:
        engine.add_embed_request("bad", prompt, EmbedParams(**params), Collector(), field="inputs[3]")
    assert raised.value.field == field
    assert engine.stats().waiting == 0

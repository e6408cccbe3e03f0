"""Rerankers (the score runner): a Qwen3 checkpoint served with --runner score gives each document
the score Qwen3-Reranker's model card computes with transformers - its prompt around the query and
the document, P("yes") from the "no" and "yes" logits at the last token - batched and chunked
alike; what a reranker engine cannot do is refused by name."""

import pytest
import torch

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from xserv_engine.errors import InputTooLong, InvalidRequest, Unsupported
from xserv_engine.models.pooling import EmbedParams

# Qwen3-Reranker's model card, verbatim
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_TASK = "Given a web search query, retrieve relevant passages that answer the query"

QUERY = "What is the capital of China?"
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. " * 5,
    "北京是中国的首都。",
]


def model_card_scores(model, tokenizer, query, documents, instruction=None) -> list[float]:
    """The model card's compute_logits over format_instruction pairs (one at a time: no padding)."""
    prefix_ids = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix_ids = tokenizer.encode(SUFFIX, add_special_tokens=False)
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    for doc in documents:
        pair = f"<Instruct>: {instruction or DEFAULT_TASK}\n<Query>: {query}\n<Document>: {doc}"
        ids = prefix_ids + tokenizer(pair, add_special_tokens=False)["input_ids"] + suffix_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.stack([logits[no], logits[yes]]).log_softmax(dim=0)[1].exp().item())
    return scores


@pytest.fixture(scope="module")
def reranker(hf_models):
    return hf_models(False)  # untied: the head's rows are its own, not the embeddings'


@pytest.fixture(scope="module")
def engine(reranker):
    engine = make_engine(reranker[0], runner="score", max_num_batched_tokens=64)  # the long document in chunks
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_tokenizer(reranker):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(reranker[0])


def score_all(engine, query, documents, instruction=None) -> list:
    collectors = [Collector() for _ in documents]
    score_all.counter += 1
    for i, (doc, collector) in enumerate(zip(documents, collectors)):
        engine.add_score_request(f"score-{score_all.counter}-{i}", query, doc, instruction, collector)
    return [collector.wait()[-1] for collector in collectors]


score_all.counter = 0


@pytest.mark.parametrize("instruction", [None, "Given a question, find the passage that answers it"])
def test_scores_equal_the_model_cards(engine, reranker, hf_tokenizer, instruction):
    outputs = score_all(engine, QUERY, DOCUMENTS, instruction)
    expected = model_card_scores(reranker[1], hf_tokenizer, QUERY, DOCUMENTS, instruction)
    got = [out.embedding[0] for out in outputs]
    assert all(len(out.embedding) == 1 for out in outputs)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-4)
    assert max(expected) - min(expected) > 1e-3  # the documents score differently: a swap would show
    assert outputs[1].usage.prompt_tokens > 64  # that one was prefilled in chunks
    wait_idle(engine)


def test_a_reranker_engine_serves_scores_only(engine):
    assert engine.model_info().runner == "score"
    with pytest.raises(Unsupported, match="serves relevance scores"):
        generate(engine, "Hello", max_tokens=2)
    with pytest.raises(Unsupported, match="reranker"):
        engine.add_embed_request("e", "Hello", EmbedParams(), Collector())


def test_other_engines_refuse_scores(tied_model_dir):
    engine = make_engine(tied_model_dir)
    try:
        with pytest.raises(Unsupported, match="Score needs a reranker"):
            engine.add_score_request("s", QUERY, "doc", None, Collector())
    finally:
        engine.shutdown()


def test_bad_documents_are_named(engine):
    with pytest.raises(InvalidRequest) as raised:
        engine.add_score_request("s", QUERY, "", None, Collector(), field="documents[2]")
    assert raised.value.field == "documents[2]"
    with pytest.raises(InputTooLong) as raised:
        engine.add_score_request("s", QUERY, "word " * 1100, None, Collector(), field="documents[1]")
    assert raised.value.field == "documents[1]"

"""What lm-evaluation-harness needs from an OpenAI-compatible server, through `xserv up` on the
demo model in fp32, checked against transformers on the same checkpoint: /v1/completions with
echo (its `local-completions` model scores a multiple-choice answer with token-id prompts, echo,
logprobs 1, max_tokens 1, summing token_logprobs[ctxlen:-1]), batches of prompts, and vLLM's
tokenizer endpoints (its `tokenizer_backend=remote`)."""

import subprocess

import openai
import pytest
import requests
import torch

from tests.support.processes import served

pytestmark = pytest.mark.e2e

CONTEXT = [785, 6722, 315, 9625, 374]  # any ids: the demo model's weights are random
CONTINUATION = [12095, 13]


@pytest.fixture(scope="module")
def up(demo_dir):
    with served("up", "--model", str(demo_dir), "--workers", "1", "--num-kv-blocks", "64", "--max-model-len", "512",
                "--dtype", "float32", "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        yield up


@pytest.fixture(scope="module")
def sdk(up):
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_tokenizer(demo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="module")
def reference(demo_dir):
    """log p(token i | tokens before it) for CONTEXT + CONTINUATION, [len - 1, V], from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([CONTEXT + CONTINUATION])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def score(sdk, prompt, **kwargs):
    fields = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, **kwargs}
    return sdk.completions.create(model=sdk.models.list().data[0].id, prompt=prompt, **fields)


def test_lm_eval_loglikelihood_request_scores_the_continuation_as_transformers(sdk, reference):
    prompt = CONTEXT + CONTINUATION
    choice = score(sdk, [prompt]).choices[0]  # lm-eval sends a batch of one
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 1  # the prompt's tokens, then the one generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [reference[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert lp.token_logprobs[1:-1] == pytest.approx(expected, abs=1e-4)
    ctxlen = len(CONTEXT)
    continuation = lp.token_logprobs[ctxlen:-1]  # what lm-eval sums
    assert sum(continuation) == pytest.approx(sum(expected[ctxlen - 1 :]), abs=1e-3)
    greedy = [max(top.values()) == token for token, top in zip(continuation, lp.top_logprobs[ctxlen:-1])]
    assert greedy == [reference[i].argmax().item() == prompt[i + 1] for i in range(ctxlen - 1, len(prompt) - 1)]
    # the echoed text is the prompt's, then the completion's
    assert choice.text.startswith("".join(lp.tokens[: len(prompt)]))
    assert lp.text_offset[: len(prompt) + 1] == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(prompt) + 1)]


def test_echo_streamed_joins_to_the_answer(sdk):
    whole = score(sdk, CONTEXT, max_tokens=5, logprobs=2, seed=3).choices[0]
    chunks = list(score(sdk, CONTEXT, max_tokens=5, logprobs=2, seed=3, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.text
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    assert streamed[0] is None and len(streamed) == len(CONTEXT) + 5


def test_echo_of_a_text_prompt_without_logprobs(sdk):
    model = sdk.models.list().data[0].id
    answer = sdk.completions.create(model=model, prompt="Once upon a time", echo=True, max_tokens=3, temperature=0)
    plain = sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert answer.choices[0].text == "Once upon a time" + plain.choices[0].text
    assert answer.choices[0].logprobs is None


def test_a_batch_of_prompts_scores_each_as_alone(sdk):
    batch = [CONTEXT + CONTINUATION, CONTEXT, [9707, 11]]
    together = score(sdk, batch).choices
    assert [c.index for c in together] == [0, 1, 2]
    for prompt, choice in zip(batch, together):
        alone = score(sdk, [prompt]).choices[0]
        assert choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=1e-5)


def test_tokenize_and_detokenize_agree_with_transformers(up, hf_tokenizer):
    text = "Hello world, 你好 🙂 <|im_end|>"
    reply = requests.post(up.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    expected = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert reply["tokens"] == expected and reply["count"] == len(expected) and reply["max_model_len"] == 512
    back = requests.post(up.url + "/detokenize", json={"tokens": expected[:5]}, timeout=30).json()
    assert back == {"prompt": hf_tokenizer.decode(expected[:5])}


def test_tokenize_a_chat_renders_it_as_transformers_does(up, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = requests.post(up.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert reply["tokens"] == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)


def test_tokenizer_info_and_errors(up, hf_tokenizer, demo_dir):
    info = requests.get(up.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == hf_tokenizer.eos_token and info["model_max_length"] == 512
    assert info["chat_template"] == (demo_dir / "chat_template.jinja").read_text()
    bad = requests.post(up.url + "/detokenize", json={"tokens": [1, 10**7]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong = requests.post(up.url + "/tokenize", json={"prompt": "x", "model": "other"}, timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    both = requests.post(up.url + "/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                         timeout=30)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"

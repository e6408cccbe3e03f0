"""End to end: `xserv up --speculative-config` serves both methods through the OpenAI API as the
same server without it does: streamed and not, chat and completions, the same greedy text."""

import json

import openai
import pytest
import requests

from tests.support.processes import free_port, served

pytestmark = pytest.mark.e2e

LOOPING = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def sdks(demo_dir):
    """name -> an SDK client of `xserv up` on the demo model: plain, n-gram, draft model (itself)."""
    configs = {"plain": None, "ngram": '{"method": "ngram", "num_speculative_tokens": 4}',
               "draft": json.dumps({"model": str(demo_dir), "num_speculative_tokens": 3})}
    clients, stack = {}, []
    try:
        for name, config in configs.items():
            metrics = free_port()
            flags = ["--model", str(demo_dir), "--num-kv-blocks", "64", "--max-model-len", "512", "--log-level", "warning",
                     "--metrics-port", str(metrics)]
            context = served("up", *flags, *(["--speculative-config", config] if config else []))
            up = context.__enter__()
            stack.append(context)
            clients[name] = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            clients[name].engine_metrics = f"http://127.0.0.1:{metrics}/metrics"
        yield clients
    finally:
        for context in reversed(stack):
            context.__exit__(None, None, None)


def completion(sdk, stream: bool) -> str:
    model = sdk.models.list().data[0].id
    if not stream:
        reply = sdk.completions.create(model=model, prompt=LOOPING, max_tokens=48, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 48
        return reply.choices[0].text
    chunks = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": LOOPING}],
                                         max_tokens=48, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True, "chat_template_kwargs":
                                                     {"enable_thinking": False}})
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["completions", "streamed-chat"])
def test_both_methods_answer_as_the_plain_server_does(sdks, stream):
    expected = completion(sdks["plain"], stream)
    assert expected
    for name in ("ngram", "draft"):
        assert completion(sdks[name], stream) == expected, name
        assert accepted_tokens(sdks[name]) > 0, name  # it did speculate


def accepted_tokens(sdk) -> float:
    text = requests.get(sdk.engine_metrics, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_total{"))

"""stream_options.continuous_usage_stats (vLLM's extra), in-process against the fake gRPC engine:
usage on every chunk that has a choice, counting that choice's tokens so far, as vLLM answers it."""

import json

import httpx2
import openai
import pytest

from .fake_grpc_engine import HELLO, MODEL_ID, UNICODE

CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def events(body: bytes) -> list[dict]:
    assert body.endswith(b"data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def test_every_chat_chunk_counts_its_choices_tokens_so_far(client):
    resp = client.simulate_post("/v1/chat/completions", json=dict(
        CHAT, n=2, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert resp.status_code == 200, resp.text
    got = events(resp.content)
    *chunks, last = got
    seen = {0: [], 1: []}  # choice -> the completion_tokens of its chunks, in order
    for chunk in chunks:
        [choice] = chunk["choices"]
        assert chunk["usage"]["prompt_tokens"] == 7
        assert chunk["usage"]["total_tokens"] == 7 + chunk["usage"]["completion_tokens"]
        seen[choice["index"]].append(chunk["usage"]["completion_tokens"])
    # the opening chunk (role) at 0, one token per content chunk, the finish chunk at the total
    assert seen == {i: [0, *range(1, len(HELLO) + 1), len(HELLO)] for i in (0, 1)}
    assert last["choices"] == [] and last["usage"] == dict(usage(7, 2 * len(HELLO)),
                                                          prompt_tokens_details={"cached_tokens": 3},
                                                          completion_tokens_details={"reasoning_tokens": 0})


def test_completions_of_several_prompts_count_each_choice_on_its_own(client):
    resp = client.simulate_post("/v1/completions", json={
        "prompt": ["first", "second unicode"], "max_tokens": 8, "stream": True,
        "stream_options": {"continuous_usage_stats": True}})
    assert resp.status_code == 200, resp.text
    *chunks, last = events(resp.content)
    final = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        final[choice["index"]] = chunk["usage"]
    assert final == {0: usage(7, len(HELLO)), 1: usage(7, len(UNICODE))}
    # include_usage is implied, as in vLLM (its include_usage defaults to true)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(HELLO) + len(UNICODE)


@pytest.mark.parametrize("options", [{"include_usage": False, "continuous_usage_stats": True},
                                     {"include_usage": True, "continuous_usage_stats": False},
                                     {"include_usage": True}])
def test_without_it_chunks_carry_null_or_no_usage(client, options):
    resp = client.simulate_post("/v1/chat/completions", json=dict(CHAT, stream_options=options))
    got = events(resp.content)
    with_choices = [e for e in got if e["choices"]]
    if options["include_usage"]:
        assert all(e["usage"] is None for e in with_choices) and got[-1]["choices"] == []
    else:
        assert all("usage" not in e for e in got)


def test_the_openai_sdk_reads_usage_on_every_chunk(client):
    sdk = openai.OpenAI(base_url="http://front/v1", api_key="unused", max_retries=0,
                        http_client=httpx2.Client(transport=httpx2.WSGITransport(app=client.app)))
    stream = sdk.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [chunk.usage.completion_tokens for chunk in stream]
    assert counts == [0, *range(1, len(HELLO) + 1), len(HELLO), len(HELLO)]

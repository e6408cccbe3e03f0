"""/v1/completions with several prompts in one request (OpenAI's and vLLM's batch form; what
lm-evaluation-harness sends with --batch_size above 1): one engine call per prompt, all at once,
prompt p's choice i answered as choice p * n + i, usage summed over the prompts."""

import json

import pytest

from .fake_grpc_engine import HELLO, UNICODE

COMPLETIONS = "/v1/completions"


def stream_choices(body: bytes) -> tuple[dict[int, str], dict[int, str], list[dict]]:
    """(text per choice index, finish_reason per index, every event) of an SSE answer."""
    events = [json.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices", []):
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    return texts, finished, events


def test_each_prompt_gets_its_n_choices_in_order(client, fake):
    before = len(fake.engine.requests)
    resp = client.simulate_post(COMPLETIONS, json={"prompt": ["first", "second unicode"], "n": 2, "max_tokens": 8})
    assert resp.status_code == 200, resp.text
    body = resp.json
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["".join(HELLO)] * 2 + ["".join(UNICODE)] * 2
    calls = fake.engine.requests[before:]
    assert sorted(call.text for call in calls) == ["first", "second unicode"]
    assert sorted(call.request_id for call in calls) == [body["id"] + "-0", body["id"] + "-1"]
    # the fake reports 7 prompt tokens (3 cached) per call: two prompts count twice, their n choices once
    assert body["usage"]["prompt_tokens"] == 14 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 6
    assert body["usage"]["completion_tokens"] == 2 * len(HELLO) + 2 * len(UNICODE)


def test_token_id_prompts_and_streaming(client):
    fields = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 8, "stream": True,
              "stream_options": {"include_usage": True}}
    resp = client.simulate_post(COMPLETIONS, json=fields)
    assert resp.status_code == 200, resp.text
    texts, finished, events = stream_choices(resp.content)
    assert texts == {0: "".join(HELLO), 1: "".join(HELLO)}
    assert finished == {0: "stop", 1: "stop"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 14
    assert resp.content.endswith(b"data: [DONE]\n\n")


def test_an_error_in_one_prompt_fails_the_request_and_cancels_the_others(client, fake):
    resp = client.simulate_post(COMPLETIONS, json={"prompt": ["fine slow", "bad error:invalid"], "max_tokens": 8})
    assert resp.status_code == 400 and resp.json["error"]["param"] == "top_p"
    slow = next(call for call in reversed(fake.engine.requests) if call.text == "fine slow")
    assert fake.engine.wait_cancelled(slow.request_id, timeout_s=10) is not None


def test_an_error_mid_stream_ends_the_stream_with_an_error_event(client, fake):
    resp = client.simulate_post(COMPLETIONS, json={"prompt": ["fine slow", "x midstream"], "max_tokens": 8,
                                                   "stream": True})
    assert resp.status_code == 200
    _, _, events = stream_choices(resp.content)
    assert "error" in events[-1] and not resp.content.endswith(b"data: [DONE]\n\n")
    slow = next(call for call in reversed(fake.engine.requests) if call.text == "fine slow")
    assert fake.engine.wait_cancelled(slow.request_id, timeout_s=10) is not None


@pytest.mark.parametrize("prompt", [["a"] * 257, [[]], [["a"]]], ids=["too-many", "empty-ids", "nested-text"])
def test_bad_batches_are_400_naming_the_prompt(client, fake, prompt):
    before = len(fake.engine.requests)
    resp = client.simulate_post(COMPLETIONS, json={"prompt": prompt})
    assert resp.status_code == 400 and resp.json["error"]["param"] == "prompt"
    assert len(fake.engine.requests) == before

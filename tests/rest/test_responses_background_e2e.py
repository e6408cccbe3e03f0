"""Background responses and conversations end to end: `xserv up` on the demo model (two gunicorn
workers), the openai SDK and the engine's GetModelInfo for its KV blocks. (An openai-agents run in
a conversation is in test_responses_e2e.py: its scripted model ends its answers, which the demo
model's random weights never do.)"""

import subprocess
import time

import grpc
import openai
import pytest

from tests.support.processes import served
from xserv.v1 import engine_pb2, engine_pb2_grpc

from .test_responses_background import poll
from .test_up_e2e import kv_blocks_back

pytestmark = pytest.mark.e2e
LONG = {"input": "Tell me a long story", "max_output_tokens": 400, "reasoning": {"effort": "none"}}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    with served("up", "--workers", "2", "--threads", "8", "--num-kv-blocks", "128", "--max-model-len", "1024",
                "--responses-store", str(store), "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        with grpc.insecure_channel(up.grpc_address) as channel:
            yield {"url": up.url, "engine": engine_pb2_grpc.EngineServiceStub(channel)}


@pytest.fixture(scope="module")
def sdk(up):
    return openai.OpenAI(base_url=up["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(sdk):
    return sdk.models.list().data[0].id


def test_background_polled_to_completion_as_a_foreground_answer(sdk, model):
    queued = sdk.responses.create(model=model, input="Hello!", max_output_tokens=12, temperature=0,
                                  reasoning={"effort": "none"}, background=True)
    assert queued.status == "queued"
    done = poll(sdk, queued.id, timeout_s=60)
    foreground = sdk.responses.create(model=model, input="Hello!", max_output_tokens=12, temperature=0,
                                      reasoning={"effort": "none"})
    assert done.status == foreground.status == "incomplete" and done.output_text == foreground.output_text


def test_cancel_mid_way_ends_the_engine_request_and_frees_its_kv_blocks(up, sdk, model):
    queued = sdk.responses.create(model=model, background=True, **LONG)
    deadline = time.monotonic() + 60
    while len(sdk.responses.retrieve(queued.id).output_text) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    info = up["engine"].GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.num_running == 1 and info.kv_blocks_free < info.kv_blocks_total
    assert sdk.responses.cancel(queued.id).status == "cancelled"
    assert kv_blocks_back(up["engine"], timeout_s=5) is not None
    cancelled = sdk.responses.retrieve(queued.id)
    assert cancelled.status == "cancelled" and len(cancelled.output_text) >= 20


def test_a_dropped_stream_resumes_with_exactly_the_events_of_an_uninterrupted_one(sdk, model):
    seen = []
    with sdk.responses.create(model=model, background=True, stream=True, **LONG) as stream:
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) > 10:
                break  # the connection drops mid-way
    response_id = seen[0].response.id
    resumed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    assert resumed[-1].type == "response.incomplete"
    whole = list(sdk.responses.retrieve(response_id, stream=True))
    assert [event.model_dump() for event in seen + resumed] == [event.model_dump() for event in whole]
    text = "".join(event.delta for event in whole if event.type == "response.output_text.delta")
    assert text == resumed[-1].response.output_text == sdk.responses.retrieve(response_id).output_text


def test_input_items_paginated(sdk, model):
    said = [{"role": "user", "content": f"note {index}"} for index in range(7)]
    response = sdk.responses.create(model=model, input=said, max_output_tokens=4, reasoning={"effort": "none"})
    first = sdk.responses.input_items.list(response.id, limit=3, order="asc")
    assert len(first.data) == 3 and first.has_more
    assert [item.content[0].text for item in first] == [f"note {index}" for index in range(7)]
    assert sdk.responses.input_items.list(response.id, limit=3).data[0].content[0].text == "note 6"


def test_a_three_turn_conversation_lists_what_was_said(sdk, model):
    conversation = sdk.conversations.create(metadata={"user": "e2e"})
    answers = []
    for question in ("What is 2+2?", "And 3+3?", "Thanks!"):
        response = sdk.responses.create(model=model, input=question, conversation=conversation.id,
                                        max_output_tokens=8, reasoning={"effort": "none"})
        answers.append(response.output_text)
        assert response.conversation.id == conversation.id
    items = list(sdk.conversations.items.list(conversation.id, order="asc"))
    said = [(item.role, item.content[0].text) for item in items]
    assert said == [("user", "What is 2+2?"), ("assistant", answers[0]), ("user", "And 3+3?"),
                    ("assistant", answers[1]), ("user", "Thanks!"), ("assistant", answers[2])]
    assert response.usage.input_tokens > 20  # the third turn saw the first two

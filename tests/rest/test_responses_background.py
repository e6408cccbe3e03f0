"""Background responses, cancel, resumable streams, input items and conversations through `xserv
rest` under gunicorn (two workers, so calls land on either) in front of the fake engine, spoken to
with the openai SDK."""

import time

import openai
import pytest
import requests

from tests.support.processes import served

from .fake_grpc_engine import MODEL_ID
from .test_responses import TOOL_EVENTS, TOOLS, responses_front

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def front(fake, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("background") / "responses.sqlite3")
    with responses_front(fake, store, workers=2) as served:
        yield served


@pytest.fixture(scope="module")
def sdk(front):
    return openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def poll(sdk, response_id: str, timeout_s: float = 20):
    deadline = time.monotonic() + timeout_s
    while True:
        response = sdk.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_background_answers_at_once_and_is_polled_to_completion(sdk):
    queued = sdk.responses.create(model=MODEL_ID, input="hi", background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = poll(sdk, queued.id)
    assert done.status == "completed" and done.output_text == "Hello world" and done.usage.output_tokens == 4


def test_cancel_stops_the_engine_call_and_keeps_the_output_so_far(sdk, fake):
    queued = sdk.responses.create(model=MODEL_ID, input="slow", background=True)
    deadline = time.monotonic() + 10
    while not sdk.responses.retrieve(queued.id).output_text:  # some output is in
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = sdk.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert fake.engine.wait_cancelled(queued.id, timeout_s=5) is not None
    time.sleep(0.3)
    after = sdk.responses.retrieve(queued.id)
    assert after.status == "cancelled" and after.output_text.startswith("t0 t1 ")
    with pytest.raises(openai.BadRequestError) as error:
        sdk.responses.cancel(queued.id)
    assert error.value.code == "invalid_state" and "cancelled" in error.value.message


def test_cancel_refusals(sdk):
    finished = sdk.responses.create(model=MODEL_ID, input="hi")
    with pytest.raises(openai.BadRequestError) as error:
        sdk.responses.cancel(finished.id)
    assert "background" in error.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.cancel("resp_unknown")
    assert missing.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as unstored:
        sdk.responses.create(model=MODEL_ID, input="hi", background=True, store=False)
    assert unstored.value.param == "background"


def test_a_dropped_background_stream_resumes_with_exactly_the_missing_events(sdk):
    seen = []
    with sdk.responses.create(model=MODEL_ID, input="use tools", tools=TOOLS, background=True,
                              stream=True) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 5:
                break  # the connection drops here
    response_id = seen[0].response.id
    resumed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    whole = list(sdk.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in seen + resumed] == [e.model_dump() for e in whole]
    assert [e.type for e in whole] == TOOL_EVENTS
    assert whole[0].response.status == "queued" and whole[-1].response.status == "completed"
    assert [e.sequence_number for e in whole] == list(range(len(TOOL_EVENTS)))


def test_a_running_stream_is_followed_live_from_another_connection_until_cancelled(sdk):
    with sdk.responses.create(model=MODEL_ID, input="slow", background=True, stream=True) as stream:
        first = next(iter(stream))
    response_id = first.response.id
    followed = []
    for event in sdk.responses.retrieve(response_id, stream=True, starting_after=0):
        followed.append(event)
        if len(followed) == 8:
            sdk.responses.cancel(response_id)
    assert [event.sequence_number for event in followed] == list(range(1, len(followed) + 1))
    deltas = "".join(event.delta for event in followed if event.type == "response.output_text.delta")
    stored = poll(sdk, response_id)
    assert stored.status == "cancelled" and deltas.startswith("t0 t1 t2 ") and stored.output_text == deltas


def test_events_of_a_response_created_without_stream_are_refused(sdk, front):
    response = sdk.responses.create(model=MODEL_ID, input="hi")
    answer = requests.get(f"{front.url}/v1/responses/{response.id}", params={"stream": "true"}, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream"


def test_input_items_are_paginated(sdk):
    said = [{"role": "user", "content": f"message {index}"} for index in range(5)]
    response = sdk.responses.create(model=MODEL_ID, input=said)
    pages = sdk.responses.input_items.list(response.id, limit=2, order="asc")
    assert len(pages.data) == 2 and pages.has_more
    items = list(pages)  # the SDK follows `after` through the pages
    assert [item.content[0].text for item in items] == [f"message {index}" for index in range(5)]
    newest = sdk.responses.input_items.list(response.id, limit=1)
    assert newest.data[0].content[0].text == "message 4"
    after = sdk.responses.input_items.list(response.id, after=items[1].id, order="asc")
    assert [item.id for item in after.data] == [item.id for item in items[2:]] and not after.has_more
    chained = sdk.responses.create(model=MODEL_ID, input="more", previous_response_id=response.id)
    listed = list(sdk.responses.input_items.list(chained.id, order="asc"))
    assert [item.id for item in listed[:5]] == [item.id for item in items]
    assert listed[5].role == "assistant" and listed[6].content[0].text == "more"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.input_items.list("resp_unknown")


def test_a_three_turn_conversation(sdk, fake):
    conversation = sdk.conversations.create(metadata={"topic": "greetings"},
                                            items=[{"role": "system", "content": "Be brief."}])
    assert conversation.metadata == {"topic": "greetings"}
    for turn in ("one", "two", "three"):
        response = sdk.responses.create(model=MODEL_ID, input=f"turn {turn}", conversation=conversation.id)
        assert response.conversation.id == conversation.id
    messages = fake.engine.requests[-1].chat.messages
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."), ("user", "turn one"), ("assistant", "Hello world"), ("user", "turn two"),
        ("assistant", "Hello world"), ("user", "turn three")]
    items = list(sdk.conversations.items.list(conversation.id, order="asc"))
    said = [(item.role, item.content[0].text) for item in items]
    assert said == [(m.role, m.content) for m in messages] + [("assistant", "Hello world")]
    item = sdk.conversations.items.retrieve(items[1].id, conversation_id=conversation.id)
    assert item.content[0].text == "turn one"
    sdk.conversations.items.delete(items[0].id, conversation_id=conversation.id)
    added = sdk.conversations.items.create(conversation.id, items=[{"role": "user", "content": "note"}])
    assert added.data[0].content[0].text == "note"
    texts = [item.content[0].text for item in sdk.conversations.items.list(conversation.id, order="asc", limit=100)]
    assert texts[0] == "turn one" and texts[-1] == "note"
    updated = sdk.conversations.update(conversation.id, metadata={"topic": "farewells"})
    assert sdk.conversations.retrieve(conversation.id).metadata == updated.metadata == {"topic": "farewells"}
    assert sdk.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError) as error:
        sdk.responses.create(model=MODEL_ID, input="hi", conversation=conversation.id)
    assert error.value.param == "conversation"


def test_past_the_background_limit_429_and_a_restart_fails_unfinished_ones(fake, tmp_path):
    store = str(tmp_path / "limited.sqlite3")
    with served_with_limit(fake, store) as first:
        sdk = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        running = sdk.responses.create(model=MODEL_ID, input="slow", background=True)
        with pytest.raises(openai.RateLimitError) as error:
            sdk.responses.create(model=MODEL_ID, input="slow", background=True)
        assert error.value.code == "too_many_background_responses"
        assert error.value.response.headers["retry-after"] == "1"
    with served_with_limit(fake, store) as restarted:
        sdk = openai.OpenAI(base_url=restarted.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        failed = sdk.responses.retrieve(running.id)
        assert failed.status == "failed" and "stopped before this response finished" in failed.error.message
        again = sdk.responses.create(model=MODEL_ID, input="hi", background=True)  # the limit is free again
        assert poll(sdk, again.id).status == "completed"


def served_with_limit(fake, store: str):
    return served("rest", "--engine", fake.address, "--workers", "1", "--threads", "8", "--responses-store", store,
                  "--max-background-responses", "1", "--log-level", "warning", timeout_s=30)

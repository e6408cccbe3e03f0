"""Two real `xserv engine` processes behind a real SGLang Model Gateway (`smg launch`, gRPC mode),
spoken to with the openai SDK: what a deployment past one machine gets from SMG.

SMG tokenizes, renders the chat template, parses reasoning and detokenizes; the engines speak
SMG's vLLM worker protocol on their normal port. The last test kills an engine: keep it last.
"""

import os
import signal
import threading
import time

import grpc
import pytest
import requests
from openai import OpenAI
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2
from xserv.v1 import engine_pb2

from tests.scaleout.gateway import CACHE_AWARE, Gateway
from tests.server.engine_process import EngineProcess, started_engines

pytestmark = pytest.mark.e2e

MODEL = "xserv-demo-qwen3-random"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with started_engines(2, "--block-size", "16", logs=tmp_path_factory.mktemp("engines")) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(engines, tmp_path_factory):
    smg = Gateway([e.address for e in engines], *CACHE_AWARE, log_path=tmp_path_factory.mktemp("smg") / "smg.log")
    try:
        smg.wait_ready(MODEL, workers=2)
        yield smg
    finally:
        smg.stop()


@pytest.fixture(scope="module")
def sdk(gateway):
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


def worker(engine: EngineProcess) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(engine.channel)


def direct_text(engine: EngineProcess, **request) -> tuple[str, int]:
    """(the answer, its prompt tokens) straight from one engine over xserv.v1, greedy."""
    responses = list(engine.stub.Generate(engine_pb2.GenerateRequest(**request), timeout=120))
    return "".join(r.text for r in responses), responses[-1].usage.prompt_tokens


def test_completion_is_the_same_through_smg_as_straight_from_an_engine(sdk, engines):
    expected, prompt_tokens = direct_text(engines[0], text="The capital of France is",
                                          params=engine_pb2.SamplingParams(max_tokens=16, temperature=0))
    answer = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0)
    assert answer.choices[0].text == expected
    assert answer.usage.prompt_tokens == prompt_tokens and answer.usage.completion_tokens == 16


def test_chat_stream_and_not_are_the_same_as_straight_from_an_engine(sdk, engines):
    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content="Hi")], enable_thinking=False)
    expected, prompt_tokens = direct_text(engines[1], chat=chat, params=engine_pb2.SamplingParams(max_tokens=12, temperature=0))
    answer = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0, extra_body=NO_THINKING)
    assert answer.choices[0].message.content == expected and answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 12)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True}, extra_body=NO_THINKING))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_n_2_gives_two_choices_and_counts_both(sdk):
    answer = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=0)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    assert answer.choices[0].text == answer.choices[1].text  # greedy: the same answer twice
    assert answer.usage.completion_tokens == 12


def test_a_stop_string_ends_the_answer_before_it(sdk):
    full = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0).choices[0].text
    stop = full[4:7]
    answer = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == full[:full.index(stop)]


def test_logprobs_come_back_when_asked(sdk):
    answer = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body=NO_THINKING)
    content = answer.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy picks the likeliest


def test_smg_default_sampling_values_are_accepted(sdk, engines):
    """What SMG sends when the client sets nothing (top_p 1, repetition_penalty 1, top_k 0,
    min_p 0, seen on the wire): served, not refused; and the same values sent straight."""
    answer = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body=NO_THINKING)
    assert answer.choices[0].finish_reason == "length"
    request = pb.GenerateRequest(request_id="defaults", tokenized=pb.TokenizedInput(input_ids=[9707, 11]),
                                 sampling_params=pb.SamplingParams(top_p=1, top_k=0, min_p=0, repetition_penalty=1,
                                                                   max_tokens=2, n=1, skip_special_tokens=True))
    [complete] = list(worker(engines[0]).Generate(request, timeout=60))
    assert complete.complete.finish_reason == "length" and len(complete.complete.output_ids) == 2


def test_a_parameter_the_engine_cannot_honour_is_invalid_argument_naming_it(engines):
    request = pb.GenerateRequest(request_id="bad", tokenized=pb.TokenizedInput(input_ids=[9707]),
                                 sampling_params=pb.SamplingParams(max_tokens=2, prompt_logprobs=1))
    with pytest.raises(grpc.RpcError) as error:
        list(worker(engines[0]).Generate(request, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in error.value.details()


def test_cache_aware_routing_follows_the_engines_kv_events(sdk, engines, gateway):
    """A long prefix is cached on engine 1 behind SMG's back (a request straight to it): SMG
    can only know from engine 1's KV events. Requests sharing the prefix then all land there
    and reuse it; engine 0 serves none of them."""
    holder, other = engines[1], engines[0]
    prefix = " ".join(f"item{i}" for i in range(120))
    events = worker(holder).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    next(events)  # the snapshot: we now see what SMG sees
    direct_text(holder, text=prefix, params=engine_pb2.SamplingParams(max_tokens=1, temperature=0))
    stored = next(e for e in events if any(ev.HasField("stored") for ev in e.events))
    events.cancel()
    assert all(len(b.token_ids) == 16 for ev in stored.events for b in ev.stored.blocks)
    time.sleep(0.5)  # SMG's subscription got the same batch
    before = {e.address: worker(e).GetLoads(pb.GetLoadsRequest()).loads[0] for e in engines}
    cached = [sdk.completions.create(model=MODEL, prompt=f"{prefix} question {i}", max_tokens=2, temperature=0)
              .usage.prompt_tokens_details.cached_tokens for i in range(4)]
    assert all(c >= 16 * 20 for c in cached), cached  # the prefix's blocks, on every request
    after = {e.address: worker(e).GetLoads(pb.GetLoadsRequest()).loads[0] for e in engines}
    assert after[holder.address].cache_hit_rate > before[holder.address].cache_hit_rate
    assert after[other.address].cache_hit_rate == before[other.address].cache_hit_rate
    assert "Learned block_size from KV event" in gateway.log_path.read_text()


def test_a_client_that_disconnects_from_smg_makes_the_engine_abort_and_free_its_blocks(gateway, engines):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "temperature": 0, "stream": True}
    with requests.post(f"{gateway.url}/v1/completions", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        assert sum(worker(e).GetLoads(pb.GetLoadsRequest()).loads[0].num_running_reqs for e in engines) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        infos = [e.model_info() for e in engines]
        if all(i.num_running == 0 and i.kv_blocks_free == i.kv_blocks_total for i in infos):
            break
        time.sleep(0.1)
    assert all(i.num_running == 0 and i.kv_blocks_free == i.kv_blocks_total for i in infos), infos


def test_requests_after_an_engine_is_killed_succeed(sdk, engines):
    """kill -9 one engine while streams run on both: what was sent after it is served."""
    results: list = []

    def stream(i: int) -> None:
        try:
            chunks = sdk.completions.create(model=MODEL, prompt=f"Story number {i}", max_tokens=40, stream=True)
            results.append("".join(c.choices[0].text for c in chunks if c.choices))
        except Exception as exc:  # the streams on the killed engine may fail: that is not asserted
            results.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(2)
    os.kill(engines[1].proc.pid, signal.SIGKILL)
    engines[1].proc.wait()
    for thread in threads:
        thread.join(120)
    after = [sdk.completions.create(model=MODEL, prompt=f"After the crash {i}", max_tokens=4) for i in range(6)]
    assert all(a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 4 for a in after)

"""LLMEngine behaviour a caller notices: caching, freeing, preemption, sampling, stops, errors."""

import threading

import pytest

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.errors import ContextTooLong, EngineOverloaded, InvalidRequest
from xserv_engine.sampling_params import SamplingParams

PROMPT = list(range(1000, 1040))  # 40 tokens: two full 16-token blocks and a partial one


@pytest.fixture(scope="module")
def engine(tied_model_dir):
    engine = make_engine(tied_model_dir, max_model_len=512)
    yield engine
    engine.shutdown()


def test_repeated_prompt_hits_the_prefix_cache_with_the_same_output(engine):
    first = generate(engine, PROMPT, max_tokens=12, temperature=0.0)
    second = generate(engine, PROMPT, max_tokens=12, temperature=0.0)
    assert first.final().usage.cached_prompt_tokens == 0
    assert second.final().usage.cached_prompt_tokens == 32
    assert second.final().usage.prompt_tokens == 40
    assert second.token_ids() == first.token_ids()
    wait_idle(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cached_prefix_changes_no_bit_of_a_seeded_sample(tied_model_dir, dtype):
    # temperature 1 on random weights: the distribution is nearly flat, so any rounding
    # difference between the cached and the uncached prefill would change the tokens
    engine = make_engine(tied_model_dir, dtype=dtype, max_model_len=512)
    try:
        runs = [generate(engine, PROMPT, max_tokens=24, seed=7, ignore_eos=True, n=2) for _ in range(2)]
        assert runs[1].final().usage.cached_prompt_tokens == 32
        assert [runs[1].token_ids(i) for i in (0, 1)] == [runs[0].token_ids(i) for i in (0, 1)]
    finally:
        engine.shutdown()


def test_abort_mid_generation_frees_every_block(engine):
    collector = Collector()
    aborted = []

    def on_output(out):
        collector(out)
        if len(collector.outputs) == 2 and not aborted:
            aborted.append(engine.abort("to-abort"))

    engine.add_request("to-abort", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True), on_output)
    outputs = collector.wait()
    assert aborted == [True]
    assert outputs[-1].finish_reason == "abort"
    assert len(outputs) < 400
    wait_idle(engine)
    assert engine.abort("to-abort") is False


def test_a_prompt_prefilled_in_chunks_samples_exactly_as_one_prefilled_whole(tied_model_dir):
    # n=2 siblings at temperature 1 with a seed: any difference in the prompt's keys and values
    # between an 8-token-chunk prefill and a one-step prefill would change the tokens. Also a
    # step made only of a chunk that ends no prompt (nothing to sample). fp32 only: in bf16 the
    # attention kernels round a 40 x 40 prompt and five 8-token chunks differently (as the batch
    # size changes bf16 matmul rounding), so there the tokens may differ after the first.
    dtype = "float32"
    runs = []
    for budget in (8192, 8):
        engine = make_engine(tied_model_dir, dtype=dtype, max_model_len=512, max_num_batched_tokens=budget)
        try:
            runs.append(generate(engine, PROMPT, max_tokens=24, seed=7, ignore_eos=True, n=2))
            wait_idle(engine)
        finally:
            engine.shutdown()
    assert [runs[1].token_ids(i) for i in (0, 1)] == [runs[0].token_ids(i) for i in (0, 1)]


def test_abort_in_the_middle_of_a_chunked_prefill_frees_every_block(tied_model_dir):
    # an 8-token budget: a 600-token prompt takes ~75 steps; a running stream's outputs time the abort
    engine = make_engine(tied_model_dir, max_num_batched_tokens=8)
    try:
        long, ticks = Collector(), []
        started = threading.Event()

        def on_tick(out):
            ticks.append(out)
            started.set()
            if len(ticks) == 6:  # the long prompt joined a few steps ago and is mid-prefill
                engine.abort("long")

        engine.add_request("ticker", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), on_tick)
        assert started.wait(30)
        engine.add_request("long", list(range(1000, 1600)), SamplingParams(max_tokens=5), long)
        outputs = long.wait()
        assert [o.finish_reason for o in outputs] == ["abort"] and outputs[0].token_ids == ()
        wait_idle(engine, timeout=30)
    finally:
        engine.shutdown()


def test_preemption_under_a_tiny_kv_budget_keeps_outputs_unchanged(tied_model_dir, engine):
    prompts = [list(range(2000 + 50 * i, 2000 + 50 * i + 20)) for i in range(4)]
    reference = [generate(engine, p, max_tokens=40, temperature=0.0, ignore_eos=True).token_ids() for p in prompts]
    small = make_engine(tied_model_dir, num_kv_blocks=8, max_model_len=128)  # 128 tokens of KV for 4 x 60
    try:
        collectors = [Collector() for _ in prompts]
        for i, (p, c) in enumerate(zip(prompts, collectors)):
            small.add_request(f"p{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), c)
        assert [c.wait() and c.token_ids() for c in collectors] == reference
        assert small.stats().preemptions > 0
        wait_idle(small)
    finally:
        small.shutdown()


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine):
    params = dict(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = generate(engine, PROMPT, **params).token_ids()
    b = generate(engine, PROMPT, **params).token_ids()
    c = generate(engine, PROMPT, **{**params, "seed": 99}).token_ids()
    assert a == b
    assert a != c


def test_n2_gives_two_choices_sharing_prompt_blocks(engine):
    result = generate(engine, list(range(3000, 3040)), n=2, max_tokens=8, temperature=1.0, seed=7)
    assert {o.index for o in result.outputs} == {0, 1}
    assert result.token_ids(0) != result.token_ids(1)
    assert result.final(1).usage.cached_prompt_tokens == 32  # choice 1 reused choice 0's full blocks
    wait_idle(engine)


def test_every_output_carries_the_prompt_length_so_a_stream_can_count_its_usage(engine):
    result = generate(engine, list(range(3100, 3140)), n=2, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    assert {o.prompt_tokens for o in result.outputs} == {40}
    for index in (0, 1):
        assert len(result.token_ids(index)) == result.final(index).usage.completion_tokens == 6
    wait_idle(engine)


def test_first_come_first_served_refuses_a_priority_by_name(engine):
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("prioritized", PROMPT, SamplingParams(max_tokens=2, priority=3), Collector())
    assert info.value.field == "priority" and "--scheduling-policy priority" in info.value.message
    assert generate(engine, PROMPT, max_tokens=2, priority=0).final().finish_reason == "length"


def test_stop_string_spanning_tokens_never_leaks(engine):
    base = generate(engine, "Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True)
    pieces = [o.text for o in base.outputs if o.text]
    assert len(pieces) > 4
    boundary = len(pieces[0]) + len(pieces[1])
    text = base.text()
    stop = text[boundary - 2 : boundary + 2]  # straddles the end of the second piece
    assert len(stop) == 4
    cut = generate(engine, "Once upon a time", max_tokens=24, temperature=0.0, stop=[stop])
    assert cut.text() == text[: text.index(stop)]
    assert cut.final().finish_reason == "stop" and cut.final().matched_stop == stop
    kept = generate(engine, "Once upon a time", max_tokens=24, temperature=0.0, stop=[stop],
                    include_stop_str_in_output=True)
    assert kept.text() == text[: text.index(stop) + len(stop)]


def test_streamed_text_equals_the_decode_of_all_tokens(engine):
    result = generate(engine, "多字节 🙂 text", max_tokens=64, temperature=1.0, seed=3, ignore_eos=True,
                      skip_special_tokens=False)
    assert result.text() == engine.tokenizer.decode(result.token_ids())


def test_stop_token_ids_and_min_tokens(engine):
    first = generate(engine, PROMPT, max_tokens=10, temperature=0.0).token_ids()
    stopped = generate(engine, PROMPT, max_tokens=10, temperature=0.0, stop_token_ids=[first[2]])
    assert stopped.token_ids() == first[:3]
    assert stopped.final().finish_reason == "stop" and stopped.final().matched_stop == first[2]
    held = generate(engine, PROMPT, max_tokens=10, temperature=0.0, stop_token_ids=[first[0]], min_tokens=5)
    assert first[0] not in held.token_ids()[:5]


def test_logprobs_and_top_logprobs(engine):
    result = generate(engine, PROMPT, max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3)
    entries = [lp for o in result.outputs for lp in o.logprobs]
    assert [e.token_id for e in entries] == result.token_ids()
    for entry in entries:
        assert len(entry.top) == 3
        assert entry.top[0].token_id == entry.token_id  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(entry.top[0].logprob) and entry.logprob <= 0


def test_penalties_and_logit_bias_change_the_output(engine):
    plain = generate(engine, PROMPT, max_tokens=8, temperature=0.0).token_ids()
    biased = generate(engine, PROMPT, max_tokens=8, temperature=0.0, logit_bias={42: 100.0}).token_ids()
    assert biased == [42] * 8
    assert plain != biased
    two = {42: 100.0, 43: 100.0}  # two forced candidates: a penalty on one lets the other win
    repeated = generate(engine, PROMPT, max_tokens=2, temperature=0.0, logit_bias=two,
                        repetition_penalty=2.0).token_ids()
    assert sorted(repeated) == [42, 43]
    frequent = generate(engine, PROMPT, max_tokens=12, temperature=0.0, logit_bias=two,
                        frequency_penalty=2.0).token_ids()
    assert set(frequent) == {42, 43}


def test_user_errors_are_typed_and_leave_the_engine_serving(engine):
    with pytest.raises(ContextTooLong, match="maximum context length is 512"):
        engine.add_request("long", list(range(500)), SamplingParams(max_tokens=20), Collector())
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", PROMPT, SamplingParams(top_p=0.0), Collector())
    assert err.value.field == "top_p"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", [999_999], SamplingParams(), Collector())
    assert err.value.field == "token_ids"
    with pytest.raises(InvalidRequest):
        engine.add_request("bad", "", SamplingParams(), Collector())
    assert generate(engine, PROMPT, max_tokens=3, temperature=0.0).final().finish_reason == "length"
    wait_idle(engine)


def test_a_failing_listener_is_aborted_and_the_engine_keeps_serving(engine):
    def broken(out):
        raise RuntimeError("listener bug")

    engine.add_request("broken", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), broken)
    assert generate(engine, PROMPT, max_tokens=3, temperature=0.0).final().finish_reason == "length"
    wait_idle(engine)


def test_full_queue_raises_engine_overloaded_until_requests_finish(tied_model_dir):
    config = EngineConfig(model=str(tied_model_dir), dtype="float32", max_queued_requests=2, num_kv_blocks=64)
    engine = EngineThread(LLMEngine(config, progress=False))  # not started: nothing leaves the queue
    queued = [Collector(n=2), Collector(n=2)]
    engine.add_request("q1", PROMPT, SamplingParams(n=2, max_tokens=3), queued[0])
    engine.add_request("q2", PROMPT, SamplingParams(n=2, max_tokens=3), queued[1])
    with pytest.raises(EngineOverloaded):
        engine.add_request("q3", PROMPT, SamplingParams(), Collector())
    with pytest.raises(InvalidRequest, match="already running"):
        engine.add_request("q1", PROMPT, SamplingParams(), Collector())
    engine.start()
    try:
        for collector in queued:
            collector.wait()
        for _ in range(2):  # finished, they left the queue and freed their ids
            again = [Collector(n=2), Collector(n=2)]
            engine.add_request("q1", PROMPT, SamplingParams(n=2, max_tokens=3), again[0])
            engine.add_request("q2", PROMPT, SamplingParams(n=2, max_tokens=3), again[1])
            assert [c.wait()[-1].finish_reason for c in again] == ["length", "length"]
    finally:
        engine.shutdown()


def test_without_max_tokens_a_request_may_run_to_the_end_of_the_context(engine):
    result = generate(engine, list(range(500)), temperature=0.0, ignore_eos=True)
    assert result.final().finish_reason == "length"
    assert result.final().usage.completion_tokens == 12  # max_model_len 512 - 500 prompt tokens
    with pytest.raises(ContextTooLong):
        engine.add_request("full", list(range(512)), SamplingParams(), Collector())


def test_shutdown_ends_every_request_in_flight_with_abort(tied_model_dir):
    engine = make_engine(tied_model_dir)
    collectors = [Collector() for _ in range(3)]
    for i, collector in enumerate(collectors):
        engine.add_request(f"s{i}", PROMPT, SamplingParams(max_tokens=900, ignore_eos=True), collector)
    engine.shutdown()
    assert [c.wait(10)[-1].finish_reason for c in collectors] == ["abort"] * 3


def test_sampling_follows_the_distribution(engine):
    two = {42: 100.0, 43: 100.0}  # two equally likely tokens, everything else negligible
    tokens = generate(engine, PROMPT, max_tokens=200, temperature=1.0, logit_bias=two, ignore_eos=True,
                      seed=11).token_ids()
    assert set(tokens) == {42, 43} and 60 < tokens.count(42) < 140
    greedy = generate(engine, PROMPT, max_tokens=8, temperature=0.0).token_ids()
    assert generate(engine, PROMPT, max_tokens=8, temperature=1.0, top_k=1).token_ids() == greedy


def test_auto_stream_interval_sends_every_token_to_few_streams_and_fewer_messages_to_many(tied_model_dir):
    """The default (auto): one output per token while at most 8 sequences decode; 40 decoding
    together get one output every ceil(40 / 8) = 5 tokens (the first and the last at once),
    with the same tokens and text as one output per token."""
    from xserv_engine.engine.llm_engine import AUTO_STREAM_MESSAGES

    def run(engine, count):
        collectors = [Collector() for _ in range(count)]
        for i, collector in enumerate(collectors):
            engine.add_request(f"auto-{count}-{i}", [1000 + i] + PROMPT, SamplingParams(
                max_tokens=14, temperature=0.0, ignore_eos=True), collector)
        return [collector.wait() for collector in collectors]

    auto = make_engine(tied_model_dir, max_model_len=512, max_num_seqs=64)
    every = make_engine(tied_model_dir, max_model_len=512, stream_interval=1, max_num_seqs=64)
    try:
        alone = run(auto, 1)[0]
        assert [len(o.token_ids) for o in alone] == [1] * 14
        many, each = run(auto, 40), run(every, 40)
    finally:
        auto.shutdown()
        every.shutdown()
    interval = -(-40 // AUTO_STREAM_MESSAGES)
    for got, reference in zip(many, each):
        sizes = [len(o.token_ids) for o in got]
        assert sizes[0] == 1 and max(sizes) == interval and len(got) <= 2 + 14 // interval, sizes
        assert [t for o in got for t in o.token_ids] == [t for o in reference for t in o.token_ids]
        assert "".join(o.text for o in got) == "".join(o.text for o in reference)
        assert [len(o.token_ids) for o in reference] == [1] * 14
        assert got[-1].finish_reason == "length" and got[-1].usage.completion_tokens == 14


def test_stream_interval_sends_every_nth_token_and_loses_none(tied_model_dir, engine):
    spaced = make_engine(tied_model_dir, max_model_len=512, stream_interval=4)
    try:
        got = generate(spaced, PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    finally:
        spaced.shutdown()
    every = generate(engine, PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [len(o.token_ids) for o in got.choice(0)] == [1, 3, 4, 2]  # the first at once, then every 4th, then the last
    assert got.token_ids() == every.token_ids()
    assert "".join(o.text for o in got.choice(0)) == "".join(o.text for o in every.choice(0))
    assert got.final().finish_reason == "length" and got.final().usage.completion_tokens == 10
    with pytest.raises(InvalidRequest, match="stream_interval"):
        LLMEngine(EngineConfig(model=str(tied_model_dir), stream_interval=0), progress=False)

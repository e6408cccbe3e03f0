"""Prefix caching through the real LLMEngine (fp32, greedy): what usage reports as cached on
repeats, concurrent twins and chat turns, and that the cache never changes an output."""

import pytest

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from xserv_engine.inputs import ChatInput
from xserv_engine.sampling_params import SamplingParams

BLOCK = 16
PROMPT = list(range(5000, 5100))  # 100 tokens: 6 full blocks before the last token
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tied_model_dir):
    engine = make_engine(tied_model_dir, max_model_len=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def uncached(tied_model_dir):
    engine = make_engine(tied_model_dir, max_model_len=512, enable_prefix_caching=False)
    yield engine
    engine.shutdown()


def cached(collector: Collector, index: int = 0) -> int:
    return collector.final(index).usage.cached_prompt_tokens


def test_every_sequential_repeat_hits_every_full_block(engine):
    before = engine.stats()
    runs = [generate(engine, PROMPT, max_tokens=4, **GREEDY) for _ in range(6)]
    assert [cached(r) for r in runs] == [0] + [96] * 5
    assert all(r.token_ids() == runs[0].token_ids() for r in runs)
    after = engine.stats()
    assert (after.prefix_cache_hits - before.prefix_cache_hits) * BLOCK == 5 * 96
    assert after.prefix_cache_queries - before.prefix_cache_queries == 6 * 6
    wait_idle(engine)


def test_concurrent_identical_prompts_share_the_first_ones_blocks(engine):
    prompt = list(range(6000, 6100))
    collectors = [Collector() for _ in range(4)]
    for i, c in enumerate(collectors):
        engine.add_request(f"twin-{i}", prompt, SamplingParams(max_tokens=8, **GREEDY), c)
    for c in collectors:
        c.wait()
    assert sorted(cached(c) for c in collectors) == [0, 96, 96, 96]
    assert all(c.token_ids() == collectors[0].token_ids() for c in collectors)
    wait_idle(engine)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_second_chat_turn_hits_the_whole_first_turn(engine):
    messages = [{"role": "system", "content": "You are terse. " * 12},
                {"role": "user", "content": "Name three prime numbers and say why they are prime."}]
    first_ids, _ = engine.tokenize(ChatInput(messages))
    first = generate(engine, ChatInput(messages), max_tokens=24, **GREEDY)
    messages += [{"role": "assistant", "content": first.text()}, {"role": "user", "content": "And two more?"}]
    second_ids, _ = engine.tokenize(ChatInput(messages))
    second = generate(engine, ChatInput(messages), max_tokens=4, **GREEDY)
    # the cache holds the KV of turn one's prompt and of every answer token fed back through the model
    computed = first_ids + first.token_ids()[:-1]
    reusable = min(common_prefix(second_ids, computed), len(second_ids) - 1) // BLOCK * BLOCK
    assert reusable >= len(first_ids) // BLOCK * BLOCK  # the template keeps turn one as a prefix
    assert cached(second) == reusable
    wait_idle(engine)


def workload(engine) -> list[list[int]]:
    """Repeats, shared prefixes and n=2 at once: every choice's greedy tokens."""
    shared = list(range(7000, 7040))
    prompts = [PROMPT, shared + [1, 2, 3], shared + [4, 5], PROMPT, shared + [1, 2, 3]]
    collectors = [Collector(n=2) for _ in prompts]
    for i, (p, c) in enumerate(zip(prompts, collectors)):
        engine.add_request(f"w-{id(engine)}-{i}", p, SamplingParams(max_tokens=20, n=2, **GREEDY), c)
    return [c.wait() and c.token_ids(k) for c in collectors for k in (0, 1)]


def test_outputs_are_identical_with_the_cache_on_and_off(engine, uncached):
    with_cache = workload(engine)
    assert workload(engine) == with_cache  # the second round hits everything
    assert workload(uncached) == with_cache
    assert uncached.stats().prefix_cache_hits == 0
    wait_idle(engine)
    wait_idle(uncached)


def test_kv_pressure_with_shared_prefixes_preempts_and_returns_every_block(tied_model_dir, uncached):
    small = make_engine(tied_model_dir, num_kv_blocks=10, max_model_len=160)  # 160 tokens of KV
    try:
        prompts = [list(range(8000, 8040)) + [i] * 5 for i in range(5)]
        runs = {}
        for name, eng in (("cached", small), ("uncached", uncached)):
            collectors = [Collector() for _ in prompts]
            for i, (p, c) in enumerate(zip(prompts, collectors)):
                eng.add_request(f"kv-{name}-{i}", p, SamplingParams(max_tokens=40, **GREEDY), c)
            runs[name] = [c.wait() and c.token_ids() for c in collectors]
        assert runs["cached"] == runs["uncached"]
        assert small.stats().preemptions > 0
        wait_idle(small)
        assert cached(generate(small, prompts[0], max_tokens=2, **GREEDY)) == 32  # the cache still works
    finally:
        small.shutdown()


def test_an_aborted_twin_leaves_the_others_and_the_cache_intact(engine):
    prompt = list(range(9000, 9100))
    collectors = [Collector() for _ in range(3)]
    for i, c in enumerate(collectors):
        engine.add_request(f"abort-twin-{i}", prompt, SamplingParams(max_tokens=30, **GREEDY), c)
    engine.abort("abort-twin-1")
    outputs = [c.wait() for c in collectors]
    assert outputs[1][-1].finish_reason == "abort"
    assert collectors[0].token_ids() == collectors[2].token_ids() and len(collectors[0].token_ids()) == 30
    wait_idle(engine)
    assert cached(generate(engine, prompt, max_tokens=2, **GREEDY)) == 96
    wait_idle(engine)


def test_a_failed_model_step_caches_nothing_it_was_to_compute(tied_model_dir):
    engine = make_engine(tied_model_dir, max_model_len=512)
    runner = engine.runner
    real_run = runner.run
    try:
        def broken(batch):
            raise RuntimeError("device lost")  # after share_computed published the step's blocks

        runner.run = broken
        failed = generate(engine, PROMPT, max_tokens=4, **GREEDY)
        assert failed.final().error and failed.final().finish_reason == "abort"
        runner.run = real_run
        wait_idle(engine)
        assert cached(generate(engine, PROMPT, max_tokens=4, **GREEDY)) == 0
    finally:
        runner.run = real_run
        engine.shutdown()

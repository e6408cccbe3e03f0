"""The prefix-cache counters on /metrics agree with what the Generate calls' usage reported, with
the real engine (demo model, fp32) behind the gRPC server."""

import pytest
from xserv.v1 import engine_pb2

from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine

from .harness import ServerThread
from .test_observability import scrape

BLOCK = 16


@pytest.fixture(scope="module")
def served(demo_dir):
    server = ServerThread()
    config = EngineConfig(model=str(demo_dir), dtype="float32", device="cpu", max_model_len=1024, block_size=BLOCK,
                          num_kv_blocks=128)
    server.load(EngineThread(LLMEngine(config, progress=False)))
    port = server.server.metrics.serve("127.0.0.1", 0)
    yield server, f"http://127.0.0.1:{port}/metrics"
    server.server.metrics.stop()
    server.close()


def generate(server, n: int = 1, **input_field) -> tuple[str, list[engine_pb2.Usage]]:
    """The text of choice 0 and the usage of every choice."""
    params = engine_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=n)
    messages = list(server.stub.Generate(engine_pb2.GenerateRequest(params=params, **input_field), timeout=60))
    usages = [m.usage for m in messages if m.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED]
    return "".join(m.text for m in messages if m.index == 0), usages


def chat(*turns: tuple[str, str]) -> engine_pb2.ChatInput:
    return engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def test_hit_and_query_counters_match_the_usage_of_the_calls(served):
    server, url = served
    before = scrape(url)
    text = "The quick brown fox jumps over the lazy dog. " * 12
    usages = []
    for n in (1, 1, 2, 1):  # repeats, and two choices sharing one prompt
        usages += generate(server, n=n, text=text)[1]
    question = ("user", "Tell me a story about a fox and a dog, in three short sentences.")
    answer, first = generate(server, chat=chat(("system", "Be brief. " * 10), question))
    _, second = generate(server, chat=chat(("system", "Be brief. " * 10), question, ("assistant", answer),
                                           ("user", "Another one?")))
    usages += first + second
    after = scrape(url)
    hits = after["xserv_prefix_cache_hits_total"] - before["xserv_prefix_cache_hits_total"]
    queries = after["xserv_prefix_cache_queries_total"] - before["xserv_prefix_cache_queries_total"]
    assert hits * BLOCK == sum(u.cached_prompt_tokens for u in usages)
    assert queries == sum((u.prompt_tokens - 1) // BLOCK for u in usages)
    assert second[0].cached_prompt_tokens >= first[0].prompt_tokens // BLOCK * BLOCK
    assert [u.cached_prompt_tokens > 0 for u in usages] == [False, True, True, True, True, False, True]

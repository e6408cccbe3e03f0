"""Multi-turn chat through the in-process engine, with the prefix cache on and off.

16 conversations of 6 turns run side by side; each turn's prompt is the conversation so far
(its own system prompt, every earlier question and answer) plus a new question, so everything
but the new question was computed in the turn before. For each setting it prints:

- the share of reusable prompt tokens served from the cache: usage's cached tokens over the full
  KV blocks (before the prompt's last token) of each prompt's longest common prefix with the
  tokens its conversation's previous turn put through the model (prompt + answer but its last
  token) - what a block-granular prefix cache could at best serve;
- TTFT p50 (all turns, and turns 2+ only), from add_request to the first output;
- the prompt tokens the engine computed (the prompt tokens less the cached ones);
- whether the engine's prefix-cache hit counter agrees with the usage fields.

Greedy answers are compared between the two runs: the cache must not change a token.

    .venv/bin/python benchmarks/multi_turn_cache.py [--model DIR] [--conversations 16] [--turns 6]
"""

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from xserv_engine.config import EngineConfig
from xserv_engine.demo import default_model_dir
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.inputs import ChatInput
from xserv_engine.sampling_params import SamplingParams

TOPICS = ("rivers", "bridges", "clocks", "forests", "comets", "harbors", "violins", "deserts",
          "glaciers", "lanterns", "orchards", "tunnels", "volcanoes", "windmills", "canyons", "lighthouses")


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int
    ttft_s: float
    answer_ids: list[int]


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    hits_agree: bool = False


class TurnCollector:
    """One request's outputs; the time of its first output and its final usage."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first_s: float | None = None
        self.text, self.token_ids, self.usage = [], [], None
        self.done = threading.Event()

    def __call__(self, out) -> None:
        if self.first_s is None:
            self.first_s = time.perf_counter() - self.start
        self.text.append(out.text)
        self.token_ids += out.token_ids
        if out.finished:
            self.usage = out.usage
            self.done.set()


def system_prompt(c: int, length_words: int) -> str:
    topic = TOPICS[c % len(TOPICS)]
    facts = " ".join(f"Fact {i}: {topic} number {c}-{i} is worth remembering." for i in range(length_words // 8))
    return f"You are guide {c}, an expert on {topic}. Answer briefly. {facts}"


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def converse(engine: EngineThread, c: int, args, progress) -> list[Turn]:
    """One conversation, turn after turn, the answer of each in the next prompt."""
    block = engine.model_info().block_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    messages = [{"role": "system", "content": system_prompt(c, args.system_words)}]
    computed: list[int] = []  # the tokens the previous turn put through the model
    turns = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": f"Question {t + 1}: tell me one more thing about {TOPICS[c % len(TOPICS)]}."})
        prompt_ids, _ = engine.tokenize(ChatInput(messages))
        collector = TurnCollector()
        engine.add_request(f"c{c}-t{t}", ChatInput(messages), params, collector)
        collector.done.wait()
        reusable = min(common_prefix(prompt_ids, computed), len(prompt_ids) - 1) // block * block
        turns.append(Turn(c, t, len(prompt_ids), collector.usage.cached_prompt_tokens, reusable,
                          collector.first_s, collector.token_ids))
        computed = prompt_ids + collector.token_ids[:-1]
        messages.append({"role": "assistant", "content": "".join(collector.text)})
        progress()
    return turns


def run(args, enable_prefix_caching: bool) -> Run:
    config = EngineConfig(model=args.model, dtype="float32", enable_prefix_caching=enable_prefix_caching,
                          num_kv_blocks=args.num_kv_blocks, mamba_track_interval=args.mamba_track_interval,
                          kv_cache_memory_gb=args.kv_cache_memory_gb)
    engine = EngineThread(LLMEngine(config, progress=False))
    engine.start()
    engine.warmup()
    done = [0]
    lock = threading.Lock()
    total = args.conversations * args.turns
    label = "on" if enable_prefix_caching else "off"

    def progress() -> None:
        with lock:
            done[0] += 1
            if done[0] % args.conversations == 0 or done[0] == total:
                print(f"  cache {label}: {done[0]}/{total} turns", flush=True)

    # one conversation of its own first, not measured: the first prefills of each shape (with and
    # without a cached prefix) pay one-off costs that would land on whichever setting runs first
    converse(engine, args.conversations, args, lambda: None)
    result = Run()
    hits_before = engine.stats().prefix_cache_hits
    start = time.perf_counter()
    with ThreadPoolExecutor(args.conversations) as pool:
        for turns in pool.map(lambda c: converse(engine, c, args, progress), range(args.conversations)):
            result.turns += turns
    result.wall_s = time.perf_counter() - start
    hits = engine.stats().prefix_cache_hits - hits_before
    result.hits_agree = hits * engine.model_info().block_size == sum(t.cached_tokens for t in result.turns)
    engine.shutdown()
    return result


def summary(label: str, r: Run) -> str:
    reusable = sum(t.reusable_tokens for t in r.turns)
    cached = sum(t.cached_tokens for t in r.turns)
    prompt = sum(t.prompt_tokens for t in r.turns)
    later = [t.ttft_s for t in r.turns if t.turn > 0] or [0.0]
    share = f"{cached / reusable:.3f}" if reusable else "n/a"
    return (f"| {label} | {share} ({cached}/{reusable}) | {statistics.median(t.ttft_s for t in r.turns) * 1e3:.1f} "
            f"| {statistics.median(later) * 1e3:.1f} | {prompt} | {prompt - cached} | {r.wall_s:.1f} "
            f"| {'yes' if r.hits_agree else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length of each turn")
    parser.add_argument("--system-words", type=int, default=160, help="about how long each system prompt is")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache size (default: the engine's)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="the cache budget: KV, and a hybrid's states and snapshots (default: the engine's)")
    parser.add_argument("--mamba-track-interval", type=int, default=None,
                        help="a hybrid's tokens between state snapshots (default: the engine's, one per block)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 keeps a busy shared CPU from stalling many small ops")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model = args.model or default_model_dir()
    runs = {}
    for enabled in (True, False):
        print(f"prefix cache {'on' if enabled else 'off'}: {args.conversations} conversations x {args.turns} turns ...",
              flush=True)
        runs[enabled] = run(args, enabled)
    same = [t.answer_ids for t in runs[True].turns] == [t.answer_ids for t in runs[False].turns]
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.max_tokens}-token answers, fp32, "
          f"{torch.get_num_threads()} torch threads; answers identical with the cache on and off: {same}")
    print("| prefix cache | reusable prompt tokens served from cache | TTFT p50 ms | TTFT p50 ms, turns 2+ "
          "| prompt tokens | prompt tokens computed | wall s | hit counter = usage |")
    print("|---|---|---|---|---|---|---|---|")
    print(summary("on", runs[True]))
    print(summary("off", runs[False]))


if __name__ == "__main__":
    main()

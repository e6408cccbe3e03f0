"""Multi-turn chat against servers side by side: xserv with its prefix cache, xserv without it,
and llama.cpp's llama-server, on the same weights (a hybrid Qwen3.5 checkpoint and its GGUF).

Each server runs the same conversations one after the other: every turn's prompt is the
conversation so far (its system prompt, each earlier question and the server's own answer) plus
a new question, streamed over /v1/chat/completions at temperature 0. For each server it prints the
TTFT p50 of the first turns and of the later ones, the prompt tokens, and the share of them the
server says it served from its cache (xserv: usage.prompt_tokens_details.cached_tokens; llama.cpp:
timings.cache_n of the last chunk).

    .venv/bin/python benchmarks/multi_turn_servers.py --model DIR \\
        [--gguf FILE --llama-server ../llamacpp/build/bin/llama-server] [--conversations 4] [--turns 6]
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, served, xserv_command  # noqa: E402
from multi_turn_cache import TOPICS, system_prompt  # noqa: E402


@dataclass
class Turn:
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0


def chat(base_url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[Turn, str]:
    """One streamed turn: (its numbers, the answer's text)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "cache_prompt": True}
    request = urllib.request.Request(base_url + "/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start, first, text, usage, timings = time.perf_counter(), None, [], {}, {}
    with urllib.request.urlopen(request, timeout=600) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(delta.get("content") or "")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n", 0)
    prompt = usage.get("prompt_tokens") or timings.get("cache_n", 0) + timings.get("prompt_n", 0)
    completion = usage.get("completion_tokens") or timings.get("predicted_n", 0)
    ttft = first if first is not None else time.perf_counter() - start
    return Turn(0, ttft, prompt, cached, completion), "".join(text)


def converse(base_url: str, model: str, c: int, args) -> list[Turn]:
    messages = [{"role": "system", "content": system_prompt(c, args.system_words)}]
    turns = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": f"Question {t + 1}: tell me one more thing about "
                                                    f"{TOPICS[c % len(TOPICS)]}."})
        turn, answer = chat(base_url, model, messages, args.max_tokens)
        turn.turn = t
        turns.append(turn)
        messages.append({"role": "assistant", "content": answer})
    return turns


def run(name: str, command, args) -> list[Turn]:
    port = free_port()
    with served(name, command(port), port, os.environ.copy(), args.ready_timeout) as base_url:
        with urllib.request.urlopen(base_url + "/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        converse(base_url, model, len(TOPICS) - 1, args)  # not measured: first prefills of each shape
        print(f"multi-turn: {name}: {args.conversations} conversations x {args.turns} turns", file=sys.stderr, flush=True)
        with ThreadPoolExecutor(args.concurrency) as pool:
            return [t for turns in pool.map(lambda c: converse(base_url, model, c, args), range(args.conversations))
                    for t in turns]


def row(name: str, turns: list[Turn]) -> str:
    first = [t.ttft_s for t in turns if t.turn == 0]
    later = [t.ttft_s for t in turns if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in turns if t.turn > 0)
    cached = sum(t.cached_tokens for t in turns if t.turn > 0)
    return (f"| {name} | {statistics.median(first) * 1e3:.0f} | {statistics.median(later) * 1e3:.0f} | {prompt} "
            f"| {cached} ({cached / max(prompt, 1):.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the Hugging Face checkpoint xserv serves")
    parser.add_argument("--gguf", default=None, help="the same weights as GGUF for llama-server (default: skipped)")
    parser.add_argument("--llama-server", default=None, help="llama-server binary")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="conversations at once")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=160)
    parser.add_argument("--xserv-args", default="", help="extra flags for xserv up")
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--skip-cache-off", action="store_true", help="leave out xserv without its prefix cache")
    args = parser.parse_args()
    servers = {"xserv, prefix cache on": lambda port: xserv_command(args, port),
               "xserv, prefix cache off": lambda port: [*xserv_command(args, port), "--no-enable-prefix-caching"]}
    if args.skip_cache_off:
        del servers["xserv, prefix cache off"]
    if args.gguf and args.llama_server:
        threads = str(os.cpu_count())
        servers["llama.cpp"] = lambda port: [
            args.llama_server, "--model", args.gguf, "--host", "127.0.0.1", "--port", str(port), "--jinja",
            "--parallel", str(args.concurrency), "--ctx-size", str(8192 * args.concurrency), "--threads", threads,
            "--threads-batch", threads]
    else:
        print("multi-turn: llama.cpp skipped: give --gguf and --llama-server", file=sys.stderr)
    results = {}
    for name, command in servers.items():
        results[name] = run(name, command, args)
        print(row(name, results[name]), file=sys.stderr, flush=True)
    print(f"\n{args.conversations} conversations x {args.turns} turns ({args.concurrency} at once), "
          f"{args.max_tokens}-token answers, bf16, {os.cpu_count()} CPUs; command: {shlex.join(sys.argv)}")
    print("| server | TTFT p50 ms, turn 1 | TTFT p50 ms, turns 2+ | prompt tokens, turns 2+ | served from cache |")
    print("|---|---|---|---|---|")
    for name, turns in results.items():
        print(row(name, turns))


if __name__ == "__main__":
    main()

"""Structured outputs: 64 streams held to one JSON schema against the same load unconstrained, in
one run, on the same engine; the mask's share of each step; first-token latency of a new schema.

Every stream gets a fresh random prompt and generates exactly --output-len tokens at temperature 1
(the schema's answers are longer than that, so no stream ends early; the unconstrained streams
ignore EOS); --temperature, --top-k and --top-p change the sampling of both loads (Qwen3's
generation_config: 0.6, 20, 0.95). Prints output tok/s of both, their ratio, the mask time per step on the engine
thread (waiting for the bitmask and applying it, for the constrained rows), the bitmask fill's
own time (on the fill thread, beside the forward pass), how many constrained rows were drawn
before any mask, how many first draws the grammar refused and how many rows were masked after
all (structured/manager.py), and the time to the first token of one
request with a schema never seen before (compile included) and with the same schema again (cached).

    .venv/bin/python benchmarks/structured_outputs.py [--model DIR] [--dtype float32] [--rounds 3]
    .venv/bin/python benchmarks/structured_outputs.py --temperature 0.6 --top-k 20 --top-p 0.95
"""

import argparse
import json
import random
import statistics
import threading
import time

from xserv_engine.openmp import wait_briefly

wait_briefly()  # before torch loads (so the imports below come after it): OpenMP threads wait as `xserv engine`'s do

import torch

from xserv_engine.config import EngineConfig
from xserv_engine.demo import default_model_dir
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.constraint import JSON_SCHEMA, Constraint

# long answers: 40 bounded strings and 40 bounded integers in nested objects
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"], "properties": {"people": {
    "type": "array", "minItems": 40, "maxItems": 40, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]}}}}}}


def prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(0, 151643) for _ in range(length)] for _ in range(n)]


def run_batch(engine, batch: list[list[int]], params: SamplingParams, tag: str) -> float:
    """Output tok/s of one batch, all requests sent at once."""
    done = threading.Semaphore(0)
    start = time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(f"{tag}-{i}", prompt, params, lambda out: out.finished and done.release())
    for _ in batch:
        done.acquire()
    return len(batch) * params.max_tokens / (time.perf_counter() - start)


def first_token_s(engine, params: SamplingParams, tag: str) -> float:
    first = threading.Event()
    start = time.perf_counter()
    engine.add_request(tag, [9707, 11, 1879], params, lambda out: first.set())
    first.wait()
    elapsed = time.perf_counter() - start
    engine.abort(tag)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (unconstrained, constrained), alternating")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off (Qwen3's generation_config: 20)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(Qwen3's generation_config: 0.95)")
    args = parser.parse_args()
    engine = EngineThread(LLMEngine(EngineConfig(model=args.model or default_model_dir(), dtype=args.dtype,
                                                 max_num_seqs=args.num_requests), progress=False))
    engine.start()
    engine.warmup()
    rng = random.Random(0)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    free = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **sampling)
    schema = SamplingParams(max_tokens=args.output_len, constraint=Constraint(JSON_SCHEMA, json.dumps(SCHEMA)), **sampling)
    structured = engine.structured
    run_batch(engine, prompts(8, args.input_len, rng), schema, "warm")  # compiles the schema once
    speeds: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    mask_ms, fill_ms = [], []
    drawn, refused, masked = structured.drawn_rows, structured.refused_rows, structured.masked_rows
    for r in range(args.rounds):
        speeds["unconstrained"].append(run_batch(engine, prompts(args.num_requests, args.input_len, rng), free, f"u{r}"))
        seconds, fill, steps = structured.mask_seconds, structured.fill_seconds, structured.mask_steps
        speeds["json schema"].append(run_batch(engine, prompts(args.num_requests, args.input_len, rng), schema, f"s{r}"))
        mask_ms.append(1e3 * (structured.mask_seconds - seconds) / (structured.mask_steps - steps))
        fill_ms.append(1e3 * (structured.fill_seconds - fill) / (structured.mask_steps - steps))
    drawn, refused = structured.drawn_rows - drawn, structured.refused_rows - refused
    masked = structured.masked_rows - masked
    new = [first_token_s(engine, SamplingParams(max_tokens=4, constraint=Constraint(JSON_SCHEMA, json.dumps(
        {**SCHEMA, "title": f"fresh {i}"}))), f"new{i}") for i in range(5)]
    cached = [first_token_s(engine, SamplingParams(max_tokens=4, constraint=schema.constraint), f"old{i}")
              for i in range(5)]
    plain = [first_token_s(engine, SamplingParams(max_tokens=4), f"plain{i}") for i in range(5)]
    engine.shutdown()
    free_med, schema_med = statistics.median(speeds["unconstrained"]), statistics.median(speeds["json schema"])
    print(f"\n{args.num_requests} streams x {args.input_len} prompt / {args.output_len} output tokens, "
          f"temperature {args.temperature:g}, top-k {args.top_k}, top-p {args.top_p:g}, "
          f"{args.dtype}, {torch.get_num_threads()} torch threads; median of {args.rounds} rounds (range)")
    print("| load | output tok/s | range | mask ms per step (engine thread: waiting, refused rows' fills, applying) "
          "| bitmask fill ms per step (fill thread and refused rows) |")
    print("|---|---|---|---|---|")
    print(f"| unconstrained | {free_med:.0f} | {min(speeds['unconstrained']):.0f}-{max(speeds['unconstrained']):.0f} "
          "| - | - |")
    print(f"| one JSON schema | {schema_med:.0f} | {min(speeds['json schema']):.0f}-{max(speeds['json schema']):.0f} "
          f"| {statistics.median(mask_ms):.1f} | {statistics.median(fill_ms):.1f} |")
    paired = [s / u for u, s in zip(speeds["unconstrained"], speeds["json schema"])]  # each round's own pair
    print(f"constrained / unconstrained: {schema_med / free_med:.2f}x (of the medians); per round "
          f"{', '.join(f'{r:.2f}' for r in paired)}, median {statistics.median(paired):.2f}x")
    print(f"constrained rows not masked first (drawn first, or a top-k row checking its likeliest tokens): {drawn}; "
          f"first draws the grammar refused: {refused / max(1, drawn):.0%}; masked after all: "
          f"{masked / max(1, drawn):.0%} (a random-weight model ignores the grammar; a trained one mostly follows it)")
    print(f"first token, one request on an idle engine (median of 5): no constraint {1e3 * statistics.median(plain):.0f} ms, "
          f"cached schema {1e3 * statistics.median(cached):.0f} ms, new schema (compile included) "
          f"{1e3 * statistics.median(new):.0f} ms")


if __name__ == "__main__":
    main()

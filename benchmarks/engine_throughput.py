"""Offline engine throughput: xserv's LLMEngine vs transformers `generate`, same prompts, same run.

64 requests of 128 random prompt tokens, 128 output tokens each (ignore_eos), on the demo model
by default, in fp32 and bf16. Prints output tok/s for both, their ratio, and the ratio to the
LM-head roofline measured here: the time of one [batch, hidden] x [hidden, vocab] matmul, i.e.
the decode speed if everything but the LM head were free.

    .venv/bin/python benchmarks/engine_throughput.py [--model DIR] [--dtypes bfloat16 float32] [--rounds 3]
"""

import argparse
import random
import statistics
import threading
import time

import torch

from xserv_engine.config import EngineConfig
from xserv_engine.demo import default_model_dir
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.sampling_params import SamplingParams
from roofline import DTYPES, lm_head_roofline  # benchmarks/roofline.py

def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(length)] for _ in range(n)]


def run_xserv(model: str, dtype: str, rounds: list, output_len: int, max_num_seqs: int) -> list[float]:
    """Output tok/s of each round; every round has prompts of its own (no prefix-cache hits)."""
    engine = EngineThread(LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max_num_seqs), progress=False))
    engine.start()
    engine.warmup()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    speeds = []
    for r, prompts in enumerate(rounds):
        done = threading.Semaphore(0)
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b{r}-{i}", prompt, params, lambda out: out.finished and done.release())
        for _ in prompts:
            done.acquire()
        speeds.append(len(prompts) * output_len / (time.perf_counter() - start))
    engine.shutdown()
    return speeds


def run_transformers(model: str, dtype: str, prompts, output_len: int, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype]).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                        min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    return len(prompts) * output_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3,
                        help="xserv rounds (fresh prompts each); the table shows their median and range")
    args = parser.parse_args()
    model = args.model or default_model_dir()
    rounds = [make_prompts(args.num_requests, args.input_len, seed=r) for r in range(args.rounds)]
    rows = []
    for dtype in args.dtypes:
        print(f"[{dtype}] xserv, {args.rounds} rounds ...", flush=True)
        speeds = sorted(run_xserv(model, dtype, rounds, args.output_len, args.num_requests))
        ours = statistics.median(speeds)
        print(f"[{dtype}] transformers generate (batch {args.hf_batch}, the first round's prompts) ...", flush=True)
        theirs = run_transformers(model, dtype, rounds[0], args.output_len, args.hf_batch)
        roof = lm_head_roofline(model, dtype, args.num_requests)
        rows.append((dtype, ours, f"{speeds[0]:.0f}-{speeds[-1]:.0f}", theirs, roof))
    print(f"\n{args.num_requests} requests x {args.input_len} prompt / {args.output_len} output tokens, "
          f"{torch.get_num_threads()} torch threads; xserv: median of {args.rounds} rounds")
    print("| dtype | xserv tok/s | xserv range | transformers tok/s | xserv / transformers | LM-head roofline tok/s "
          "| xserv / roofline | range / roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, ours, spread, theirs, roof in rows:
        low, high = (float(x) / roof for x in spread.split("-"))
        print(f"| {dtype} | {ours:.0f} | {spread} | {theirs:.0f} | {ours / theirs:.2f}x | {roof:.0f} | {ours / roof:.2f} "
              f"| {low:.2f}-{high:.2f} |")


if __name__ == "__main__":
    main()

"""One stream through the engine, eager against torch.compile, side by side in one run.

The question: does compiling the decode step pay on this CPU? A small-batch step is mostly
per-op overhead outside the LM head, which is what compilation (fusing the norms, rotary,
activation and residual ops of each layer) should remove. Two engines on the demo model, built
the same way except that the second one's decoder layers are compiled by inductor (torch.compile,
dynamic shapes, freezing, so inductor packs their weights for oneDNN itself; attention stays
eager, a graph break per layer; the LM head keeps the engine's packed linear). Rounds alternate
between the two, so machine noise hits both alike. Prints each variant's decode step time and
tok/s, their ratio, the compile time, whether the greedy tokens are identical, and the batch-1
LM-head ceiling measured in the same run.

    .venv/bin/python benchmarks/step_overhead.py [--dtype float32] [--rounds 3] [--output-len 128]
"""

import argparse
import random
import statistics
import threading
import time

import torch
import torch._inductor.config as inductor_config

import xserv_engine.engine.model_runner as model_runner
from roofline import lm_head_roofline  # benchmarks/roofline.py
from xserv_engine.config import EngineConfig
from xserv_engine.demo import default_model_dir
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.layers.attention import Attention
from xserv_engine.layers.linear import pack_cpu_linears
from xserv_engine.sampling_params import SamplingParams


def compiled_engine(config: EngineConfig) -> tuple[EngineThread, float]:
    """An engine whose decoder layers run compiled; returns it and its compile seconds."""
    inductor_config.freezing = True  # weights are constants: inductor packs them for oneDNN
    original = model_runner.pack_cpu_linears
    # the LM head only: dynamo cannot trace the packed layers, inductor packs them instead
    model_runner.pack_cpu_linears = lambda model, dtype: pack_cpu_linears(model.lm_head, dtype)
    try:
        engine = LLMEngine(config, progress=False)
    finally:
        model_runner.pack_cpu_linears = original
    for module in engine.runner.model.modules():
        if isinstance(module, Attention):  # paged attention reads host metadata: left eager
            module.forward = torch.compiler.disable(module.forward)
    engine.runner.model.model = torch.compile(engine.runner.model.model, dynamic=True)
    thread = EngineThread(engine)
    thread.start()
    start = time.perf_counter()
    thread.warmup()  # a prefill and a decode: both graph shapes compile here
    return thread, time.perf_counter() - start


def one_stream(engine: EngineThread, prompt: list[int], output_len: int, tag: str) -> tuple[float, list[int]]:
    """Seconds per decode step (first token to last) and the greedy tokens."""
    times, tokens, done = [], [], threading.Event()

    def on_output(out):
        if out.token_ids:
            times.append(time.perf_counter())
            tokens.extend(out.token_ids)
        if out.finished:
            done.set()

    engine.add_request(tag, prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True), on_output)
    done.wait()
    return (times[-1] - times[0]) / (len(tokens) - 1), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=190)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    model = args.model or default_model_dir()
    config = EngineConfig(model=model, dtype=args.dtype, max_num_seqs=1)
    eager = EngineThread(LLMEngine(config, progress=False))
    eager.start()
    eager.warmup()
    compiled, compile_s = compiled_engine(config)
    rng = random.Random(0)
    steps = {"eager": [], "compiled": []}
    same = True
    for r in range(args.rounds):
        prompt = [rng.randrange(0, 151643) for _ in range(args.input_len)]
        results = {}
        for name, engine in (("eager", eager), ("compiled", compiled)):
            seconds, tokens = one_stream(engine, prompt, args.output_len, f"{name}-{r}")
            steps[name].append(seconds)
            results[name] = tokens
        same &= results["eager"] == results["compiled"]
    eager.shutdown()
    compiled.shutdown()
    ceiling = lm_head_roofline(model, args.dtype, batch=1)
    e, c = statistics.median(steps["eager"]), statistics.median(steps["compiled"])
    print(f"demo model, {args.dtype}, one stream, {args.input_len} prompt / {args.output_len} new tokens, "
          f"{torch.get_num_threads()} torch threads, median of {args.rounds} rounds")
    print("| variant | decode step ms (min-max) | tok/s | of the LM-head ceiling |")
    print("|---|---|---|---|")
    for name, median in (("eager", e), ("compiled", c)):
        lo, hi = min(steps[name]) * 1e3, max(steps[name]) * 1e3
        print(f"| {name} | {median * 1e3:.2f} ({lo:.2f}-{hi:.2f}) | {1 / median:.1f} | {1 / median / ceiling:.2f} |")
    print(f"compiled / eager step time: {c / e:.2f}; compile (first start) {compile_s:.1f} s; "
          f"greedy tokens identical: {same}; LM-head ceiling {ceiling:.1f} tok/s")


if __name__ == "__main__":
    main()

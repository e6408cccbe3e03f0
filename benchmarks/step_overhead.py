"""One stream through the engine: the torch ops, the native CPU ops and torch.compile, side by
side in one run.

The question: what removes the per-step overhead at batch 1 on this CPU? A small-batch step is
mostly per-op overhead outside the LM head. Three engines on the demo model, built the same way
except: "eager" runs the cpu-torch route (`--enforce-eager`: plain torch ops); "native" is the
default engine, the cpu-native route (the same model calling the ops of
xserv_engine/layers/cpu_ops.cpp); "compiled" runs the torch path with its decoder layers
compiled by inductor (torch.compile, dynamic shapes, freezing, so inductor packs their weights
for oneDNN itself; attention stays eager, a graph break per layer; the LM head keeps the engine's
packed linear). Rounds alternate between them, so machine noise hits all alike. Prints each
variant's decode step time and tok/s, its fraction of the batch-1 LM-head ceiling measured in
the same run, the compile time, and whether the greedy tokens are identical to the eager ones.

    .venv/bin/python benchmarks/step_overhead.py [--dtype float32] [--rounds 3] [--output-len 128] \
        [--variants eager native compiled]
"""

import argparse
import random
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

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
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto (default): the engine's (bfloat16 where the CPU has native bf16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=190)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["eager", "native", "compiled"],
                        choices=("eager", "native", "compiled"))
    args = parser.parse_args()
    model = args.model or default_model_dir()
    config = EngineConfig(model=model, dtype=args.dtype, max_num_seqs=1)
    engines, compile_s = {}, None
    for name in args.variants:
        if name == "compiled":  # the torch ops compiled: the native ops stay out of it
            engines[name], compile_s = compiled_engine(replace(config, enforce_eager=True))
        else:
            engines[name] = EngineThread(LLMEngine(replace(config, enforce_eager=name == "eager"), progress=False))
            engines[name].start()
            engines[name].warmup()
    dtype = str(engines[args.variants[0]].runner.dtype).removeprefix("torch.")
    rng = random.Random(0)
    steps = {name: [] for name in engines}
    same = {name: True for name in engines}
    for r in range(args.rounds):
        prompt = [rng.randrange(0, 151643) for _ in range(args.input_len)]
        tokens = {}
        for name, engine in engines.items():
            seconds, tokens[name] = one_stream(engine, prompt, args.output_len, f"{name}-{r}")
            steps[name].append(seconds)
        for name in engines:
            same[name] &= tokens[name] == tokens[args.variants[0]]
    for engine in engines.values():
        engine.shutdown()
    ceiling = lm_head_roofline(model, dtype, batch=1)
    print(f"{Path(model).name}, {dtype}, one stream, {args.input_len} prompt / {args.output_len} new tokens, "
          f"{torch.get_num_threads()} torch threads, median of {args.rounds} rounds")
    print(f"| variant | decode step ms (min-max) | tok/s | of the LM-head ceiling | greedy tokens as {args.variants[0]} |")
    print("|---|---|---|---|---|")
    for name in engines:
        median, lo, hi = statistics.median(steps[name]), min(steps[name]) * 1e3, max(steps[name]) * 1e3
        print(f"| {name} | {median * 1e3:.2f} ({lo:.2f}-{hi:.2f}) | {1 / median:.1f} | {1 / median / ceiling:.2f} "
              f"| {same[name]} |")
    if compile_s is not None:
        print(f"compile (first start): {compile_s:.1f} s")
    print(f"LM-head ceiling: {ceiling:.1f} tok/s")


if __name__ == "__main__":
    main()

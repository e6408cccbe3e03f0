"""What serving through LoRA adapters costs against the bare base model: one in-process engine
with two random adapters loaded, at 1 and 64 concurrent streams, in one run.

    .venv/bin/python benchmarks/lora.py [--model DIR] [--concurrency 1 64] [--rounds 3] \
        [--max-tokens 64] [--rank 16] [--targets q_proj k_proj ...]

The adapters are written here in PEFT's on-disk layout (adapter_config.json,
adapter_model.safetensors, random A and B), rank --rank on every projection in --targets, with
shapes from the model's config.json. Four workloads take turns each round, in an order that
rotates round by round so that this machine's drift hits them alike: base (no adapter), base op
by op (CUDA graphs switched off for it; on the CPU every step runs op by op anyway), adapter (every request names adapter A) and
mixed (half A, half B; at 1 stream it is one request of A).
Every request is a short prompt (under one KV block: no prefix-cache hits) and asks for
--max-tokens greedy tokens with ignore_eos. Output tok/s counts every stream's tokens over the
wall time from the first request to the last finish (median of the rounds); TTFT p50 is over
every request of the rounds.

A batch that holds an adapter runs op by op: no CUDA graphs. The 1-stream ratio includes that; "base, op by op" against "adapter" is
what the adapter's own matmuls cost.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from xserv_engine.config import EngineConfig
from xserv_engine.demo import default_model_dir
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.sampling_params import SamplingParams

from grpc_overhead import Result, cpu_name, prompts, spread  # benchmarks/grpc_overhead.py

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# request i names names[i % len(names)]; "base, op by op": the base model with CUDA graphs switched
# off for its rounds, the path every batch with an adapter takes (on the CPU every step runs so)
WORKLOADS = {"base": [None], "base, op by op": [None], "adapter": ["A"], "mixed": ["A", "B"]}


def projection_shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """PEFT projection -> (its module, in_features, out_features) in a Qwen3 decoder layer."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i),
            "down_proj": ("mlp", i, h)}


def write_adapter(model_dir: str, out: Path, rank: int, targets: list[str], seed: int) -> None:
    """A random LoRA adapter for the model in model_dir, as PEFT's save_pretrained lays it out."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = projection_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in targets:
            module, fan_in, fan_out = shapes[proj]
            prefix = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none",
        "use_dora": False, "modules_to_save": None, "use_rslora": False, "task_type": "CAUSAL_LM"}))


def run(engine: EngineThread, count: int, max_tokens: int, names: list, tag: str) -> Result:
    """`count` requests at once, request i through adapter names[i % len(names)] (None: the base)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    texts, ttfts, tokens, done = prompts(count), [0.0] * count, [0] * count, threading.Semaphore(0)

    def record(i: int, sent: float):
        def on_output(output) -> None:  # on the engine's thread
            if output.token_ids and not tokens[i]:
                ttfts[i] = time.perf_counter() - sent
            tokens[i] += len(output.token_ids)
            if output.finished:
                done.release()
        return on_output

    graphs = engine.runner.decode_buckets
    if tag.endswith("op by op"):  # the engine is idle between runs: its next step reads this
        engine.runner.decode_buckets = None
    start = time.perf_counter()
    for i in range(count):
        engine.add_request(f"{tag}-{i}", texts[i], params, record(i, time.perf_counter()),
                           lora_name=names[i % len(names)])
    for _ in range(count):
        done.acquire()
    wall = time.perf_counter() - start
    engine.runner.decode_buckets = graphs
    return Result(count, sum(tokens), wall, ttfts)


def compare(engine: EngineThread, concurrency: list[int], max_tokens: int, rounds: int) -> dict:
    """(streams, workload) -> every round's Result; the workloads' order rotates round by round."""
    for name, names in WORKLOADS.items():
        run(engine, max(concurrency), max_tokens, names, f"warm-{name}")
    results: dict = {}
    order = list(WORKLOADS)
    for n in concurrency:
        for r in range(rounds):
            for name in order[r % len(order):] + order[: r % len(order)]:
                results.setdefault((n, name), []).append(run(engine, n, max_tokens, WORKLOADS[name], f"c{n}-r{r}-{name}"))
            print(f"{n} streams, round {r + 1}/{rounds}: " + ", ".join(
                f"{name} {results[(n, name)][-1].tok_per_s:.0f} tok/s" for name in order), flush=True)
    return results


def table(results: dict, concurrency: list[int]) -> str:
    lines = ["| streams | workload | output tok/s (median) | tok/s range | / base | TTFT p50 (ms) |",
             "|---:|---|---:|---:|---:|---:|"]
    for n in concurrency:
        base = statistics.median(result.tok_per_s for result in results[(n, "base")])
        for name in WORKLOADS:
            runs = results[(n, name)]
            speed = statistics.median(result.tok_per_s for result in runs)
            ttft = 1000 * statistics.median(t for result in runs for t in result.ttfts_s)
            lines.append(f"| {n} | {name} | {speed:.1f} | {spread(runs)} | {speed / base:.3f} | {ttft:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Qwen3 checkpoint directory (default: the demo model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per concurrency; the median is shown")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(PROJECTIONS), choices=PROJECTIONS)
    args = parser.parse_args()
    model = args.model or default_model_dir()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xserv-lora-bench-") as tmp:
        for seed, name in enumerate("AB"):
            write_adapter(model, Path(tmp) / name, args.rank, args.targets, seed)
        config = EngineConfig(model=model, dtype=args.dtype, device=args.device, enable_lora=True,
                              lora_modules=(("A", f"{tmp}/A"), ("B", f"{tmp}/B")), max_lora_rank=max(64, args.rank))
        engine = EngineThread(LLMEngine(config, progress=False))
    engine.start()
    engine.warmup()
    try:
        results = compare(engine, args.concurrency, args.max_tokens, args.rounds)
    finally:
        engine.shutdown()
    print(f"\nmodel {model}, {engine.setup.dtype}, {engine.setup.device}; adapters of rank {args.rank} on "
          f"{' '.join(args.targets)}; max_tokens={args.max_tokens}, median of {args.rounds} rounds, "
          f"{time.perf_counter() - started:.0f} s in all")
    print(f"route: {engine.setup.route.value}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"python {platform.python_version()}, torch {torch.__version__}\n")
    print(table(results, args.concurrency))


if __name__ == "__main__":
    main()

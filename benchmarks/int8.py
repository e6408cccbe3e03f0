"""8-bit weights side by side: xserv bf16 and int8 (W8A8) against llama.cpp's bf16 and Q8_0, on
one random-weight checkpoint of a real Qwen3 shape, at 1 and 16 streams, with the memory ceiling.

    python benchmarks/int8.py --llama-cpp-dir ../llamacpp/src --llama-server ../llamacpp/build/bin/llama-server \\
        --convert-python ../llamacpp/venv/bin/python          # Qwen3-0.6B's shape, all four servers
    python benchmarks/int8.py --servers xserv-int8 xserv-bf16    # xserv alone

The checkpoint (Qwen3-0.6B's shape by default, --config for another) is written once by
make_random_model.py into the user cache; llama.cpp's GGUFs (bf16 and q8_0) are converted once
beside it with its convert_hf_to_gguf.py. Each server then runs alone on free 127.0.0.1 ports,
one after the other, through the same load (`xserv bench`'s library, as compare.py and moe.py):
--rounds requests per stream, ~190-token random prompts, 64 new tokens, greedy, ignore_eos.

Also measured in the same run: this machine's memory read bandwidth (the best of several sums
over a 1 GiB tensor on all cores) and, from it, each format's one-stream ceiling: the weight bytes
a decode step reads (every decoder linear and the LM head; int8 adds its per-channel scales) over
that bandwidth. Prints the CPU, one table per stream count with every server's row, and xserv
int8's ratios to llama.cpp Q8_0 and to the int8 ceiling (by its ITL p50, a decode step's rate,
and by out tok/s, which also counts each request's prefill). The sum is also timed on one
thread: where all cores read about as many times one core's rate as there are cores, the probe
is held by how fast each core can stream (its misses in flight), not by the memory, and a decode
step's other work, which leaves those cores' reads idle, counts against the ceiling in full.

This VM's read bandwidth moves between ~30 and ~80 GB/s within minutes, so a ceiling probed
before and after a server's run can belong to another minute than its requests. Phase-paired
rounds hold each request to its own minute: while each server is still up, --paired times
(default 6) the probe, one request alone (one stream), the probe again; each round's decode rate
(1 / its ITL p50) over the ceiling of the two probes' mean, for that server's format (int8,
Q8_0's 34 bytes per 32 weights, bf16). Printed per server: the median of the rounds and their
range.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time
from functools import cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import bench_config, comparison_table, xserv_command  # noqa: E402
from moe import (add_peer_arguments, checkpoint, cpu_description, gguf,  # noqa: E402
                 llama_server_command, peer_args, run_server)
from xserv_cli.bench import random_prompts  # noqa: E402
from xserv_cli.bench.client import send_request  # noqa: E402

SERVERS = ("xserv-int8", "llama.cpp-q8_0", "xserv-bf16", "llama.cpp-bf16")
# server -> (its weight format, bytes per weight, per-channel float32 scales): what its ceiling counts
FORMATS = {"xserv-int8": ("int8", 1.0, True), "llama.cpp-q8_0": ("Q8_0", 34 / 32, False),
           "xserv-bf16": ("bf16", 2.0, False), "llama.cpp-bf16": ("bf16", 2.0, False)}


@cache
def probe_tensor() -> torch.Tensor:
    return torch.ones(2**28)


def read_bandwidth_gb_s(rounds: int = 7, threads: int | None = None) -> float:
    """GB/s of the best sum over a 1 GiB float32 tensor (read once per sum; all cores, or `threads`)."""
    x = probe_tensor()
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        x.sum()
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best / 1e9


def step_weight_bytes(config: dict, bytes_per_weight: float, scales: bool) -> float:
    """Bytes one decode step of one sequence reads: the decoder's linears (of an MoE layer: its
    router and top-k experts, every layer taken as MoE) and the LM head (the tied or untied head:
    either way V x H), plus one float32 scale per output channel for int8."""
    h, v = config["hidden_size"], config["vocab_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    inter = config["intermediate_size"]
    if config.get("num_experts"):  # an MoE layer reads its router and its token's top-k experts
        inter = config["num_experts_per_tok"] * config["moe_intermediate_size"]
    outs = (q + 2 * kv) + h + 2 * inter + h  # qkv, o, gate_up, down rows
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + h * config.get("num_experts", 0)
    weights = config["num_hidden_layers"] * per_layer + v * h
    channels = config["num_hidden_layers"] * outs + v
    return weights * bytes_per_weight + (channels * 4 if scales else 0)


def paired_rounds(args, base_url: str, prompts: list[str]) -> list[tuple[float, float]]:
    """(GB/s, ITL p50 ms) of each phase-paired round: the probe, one request alone, the probe
    again; the GB/s is the two probes' mean."""
    config = bench_config(argparse.Namespace(**vars(args), concurrency=1, request_rate=float("inf")), base_url,
                          ignore_eos=True)
    rounds = []
    for prompt in prompts:
        before = read_bandwidth_gb_s(3)
        result = send_request(config, prompt)
        after = read_bandwidth_gb_s(3)
        if not result.ok or len(result.chunk_times) < 2:
            raise RuntimeError(f"a paired request failed ({result.error_kind}): {result.error}")
        rounds.append(((before + after) / 2, 1000 * statistics.median(result.itls_s)))
    return rounds


def of_ceiling(config: dict, name: str, rounds: list[tuple[float, float]]) -> list[float]:
    """Each paired round's decode rate over its own minute's one-stream ceiling for the server's format."""
    _, per_weight, scales = FORMATS[name]
    step_bytes = step_weight_bytes(config, per_weight, scales)
    return [1000.0 / itl / (gb_s * 1e9 / step_bytes) for gb_s, itl in rounds]


def commands(args, model: str) -> dict:
    """server name -> a function of the port that gives its command line."""
    found = {}
    for name in args.servers:
        if name.startswith("xserv"):
            extra = " --quantization int8" if name == "xserv-int8" else ""
            variant = argparse.Namespace(**{**vars(args), "xserv_args": args.xserv_args + extra})
            found[name] = lambda port, variant=variant: xserv_command(variant, port)
        elif args.llama_cpp_dir is None:
            print(f"int8: {name} skipped: no --llama-cpp-dir (its source tree, for convert_hf_to_gguf.py)",
                  file=sys.stderr)
        else:
            path = gguf(args, model, name.split("-")[1])
            found[name] = lambda port, path=path: llama_server_command(args, path, port)
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, "config-Qwen3-0.6B.json", "all")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--paired", type=int, default=6, help="phase-paired rounds per server: the probe, "
                        "one request alone, the probe (default: 6; 0: none)")
    return peer_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cpu = cpu_description()
    print(f"int8: CPU: {cpu}", file=sys.stderr)
    model = checkpoint(args)
    config = json.loads((Path(model) / "config.json").read_text())
    prompts = {n: random_prompts(n * args.rounds, args.input_len, args.seed) for n in args.streams}
    bandwidth = read_bandwidth_gb_s()
    paired_prompts = random_prompts(args.paired, args.input_len, args.seed + 1)
    results, paired = {}, {}
    for name, command in commands(args, model).items():
        def then(base_url, name=name):
            if args.paired:
                print(f"int8: {name}, {args.paired} phase-paired rounds", file=sys.stderr, flush=True)
                paired[name] = paired_rounds(args, base_url, paired_prompts)
        try:
            results[name] = run_server(args, name, command, prompts, then)
        except RuntimeError as exc:  # one server that did not start or answer: still measure the others
            print(f"int8: {name} failed: {exc}", file=sys.stderr)
    after = read_bandwidth_gb_s()
    one_thread = read_bandwidth_gb_s(3, threads=1)  # the same minute as `after`
    bandwidth = max(bandwidth, after)  # before and after: the better of the two
    ceilings = {"int8": bandwidth * 1e9 / step_weight_bytes(config, 1, True),
                "bf16": bandwidth * 1e9 / step_weight_bytes(config, 2, False)}
    print(f"\n{Path(model).name}: {args.input_len}-token prompts, {args.output_len} new tokens, greedy, "
          f"{args.rounds} request(s) per stream\nCPU: {cpu}\nmemory read bandwidth {bandwidth:.1f} GB/s: "
          f"one-stream ceiling int8 {ceilings['int8']:.1f} tok/s, bf16 {ceilings['bf16']:.1f} tok/s\n"
          f"the sum after the servers: {after:.1f} GB/s on all {torch.get_num_threads()} threads, "
          f"{one_thread:.1f} on one ({after / one_thread:.2f}x)")
    for streams in args.streams:
        reports = {name: r[streams] for name, r in results.items()}
        print(f"\n{streams} stream(s)\n" + comparison_table(reports))
        ours, peer = reports.get("xserv-int8"), reports.get("llama.cpp-q8_0")
        if ours and peer and peer.output_throughput:
            print(f"xserv int8 / llama.cpp Q8_0: {ours.output_throughput / peer.output_throughput:.2f}x tok/s")
        if ours and streams == 1:  # a decode step's rate (1 / ITL) is what the ceiling bounds; out tok/s adds the prefill
            by_itl = 1000.0 / ours.itl_ms.p50 / ceilings["int8"] if ours.itl_ms.p50 else 0.0
            print(f"xserv int8 at one stream: {by_itl:.2f} of the int8 ceiling by ITL p50 "
                  f"({ours.output_throughput / ceilings['int8']:.2f} by out tok/s, which counts the prefill)")
    if paired:
        print(f"\nphase-paired, one stream ({args.paired} rounds each: the probe, one request alone, the probe): "
              f"decode rate (1 / ITL p50) over the ceiling of the round's own probes")
        for name, rounds in paired.items():
            fractions = of_ceiling(config, name, rounds)
            probes = [gb_s for gb_s, _ in rounds]
            print(f"  {name:<16} {statistics.median(fractions):.2f} of the {FORMATS[name][0]} ceiling "
                  f"(rounds {min(fractions):.2f}-{max(fractions):.2f}; ITL p50 {statistics.median(itl for _, itl in rounds):.1f} ms; "
                  f"probe {min(probes):.1f}-{max(probes):.1f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "model": model, "bandwidth_gb_s": bandwidth, "one_thread_gb_s": one_thread,
                       "ceilings": ceilings}
                      | {f"{name} {n}": json.loads(report.to_json()) for name, r in results.items()
                         for n, report in r.items()}
                      | {f"{name} paired": [{"gb_s": gb_s, "itl_p50_ms": itl} for gb_s, itl in rounds]
                         for name, rounds in paired.items()}, f, indent=2)
    return 0 if results else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("int8: interrupted; every server it started is stopped")

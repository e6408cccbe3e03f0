"""8-bit weights side by side: xserv bf16 and int8 (W8A8) against llama.cpp's bf16 and Q8_0, on
one random-weight checkpoint of a real Qwen3 or Qwen3.5 shape, at 1 and 16 streams, with the
memory ceiling and the time to first token of one long prompt.

    python benchmarks/int8.py --llama-cpp-dir ../llamacpp/src --llama-server ../llamacpp/build/bin/llama-server \\
        --convert-python ../llamacpp/venv/bin/python          # Qwen3-0.6B's shape, all four servers
    python benchmarks/int8.py --servers xserv-int8 xserv-bf16    # xserv alone
    python benchmarks/int8.py --config ../shared/reference/qwen3_5/config-Qwen3.5-35B-A3B.json --num-layers 8 \\
        --llama-cpp-dir ../llamacpp/src --convert-python ../llamacpp/venv/bin/python   # a hybrid MoE, 2 groups of 4

The checkpoint (Qwen3-0.6B's shape by default, --config for another) is written once by
make_random_model.py into the user cache; llama.cpp's GGUFs (bf16 and q8_0) are converted once
beside it with its convert_hf_to_gguf.py. Each server then runs alone on free 127.0.0.1 ports,
one after the other, through the same load (`xserv bench`'s library, as compare.py and moe.py):
--rounds requests per stream, ~190-token random prompts, 64 new tokens, greedy, ignore_eos.
Then, still alone, each server's time to first token of one --prefill-len-token prompt (2,048 by
default; --prefill-rounds prompts, each new, so no cache holds it), median and best. Last, the
ratios the issues set targets for: one stream's tok/s, bf16 against bf16 and int8 against Q8_0;
the most streams' tok/s, xserv's best against llama.cpp's best; the long prompt's TTFT.

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
import re
import statistics
import sys
import time
from functools import cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import bench_config, comparison_table, xserv_command  # noqa: E402
from make_random_model import checkpoint_shapes, text_config  # noqa: E402
from moe import add_peer_arguments, gguf, llama_server_command, peer_args, run_server, start  # noqa: E402
from xserv_cli.bench import random_prompts  # noqa: E402
from xserv_cli.bench.client import send_request  # noqa: E402

SERVERS = ("xserv-int8", "llama.cpp-q8_0", "xserv-bf16", "llama.cpp-bf16")
# the targets: one stream, xserv's tok/s over its peer's at least (bf16 pair, 8-bit pair)
PAIRS = (("xserv-bf16", "llama.cpp-bf16", 1.0), ("xserv-int8", "llama.cpp-q8_0", 1.2))
MANY_STREAMS_TARGET = 2.5  # xserv's best tok/s at the most streams over llama.cpp's best
PREFILL_TARGET = 2.0  # llama.cpp's best long-prompt TTFT over xserv's best
PREFILL_NEW_TOKENS = 2  # the long prompts ask for little: their TTFT is the prefill
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
    router, its token's top-k experts and any shared expert) and the LM head (the tied or untied
    head: either way V x H), plus one float32 scale per output channel for int8."""
    text = text_config(config)
    experts_read = text["num_experts_per_tok"] / text["num_experts"] if text.get("num_experts") else 1.0
    head = ("lm_head.weight", (text["vocab_size"], text["hidden_size"]))
    tied_head = [head] if text.get("tie_word_embeddings") else []  # the embedding read as the head
    weights = channels = 0.0
    for name, shape in checkpoint_shapes(config) + tied_head:
        if len(shape) != 2 or name.endswith("embed_tokens.weight"):  # norms, conv taps, gates: vectors; rows gathered
            continue
        share = experts_read if re.search(r"\.experts\.\d+\.", name) else 1.0
        weights += share * shape[0] * shape[1]
        channels += share * shape[0]
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


def prefill_ttfts(args, base_url: str, prompts: list[str]) -> list[tuple[float, int]]:
    """(TTFT s, prompt tokens the server counted) of each long prompt, sent alone, one after the other."""
    load = vars(args) | {"concurrency": 1, "request_rate": float("inf"), "output_len": PREFILL_NEW_TOKENS}
    config = bench_config(argparse.Namespace(**load), base_url, ignore_eos=True)
    timed = []
    for prompt in prompts:
        result = send_request(config, prompt)
        if not result.ok or not result.chunk_times:
            raise RuntimeError(f"a long prompt failed ({result.error_kind}): {result.error}")
        timed.append((result.ttft_s, result.prompt_tokens or 0))
    return timed


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
            found[name] = lambda port, path=path: llama_server_command(args, path, port, args.prefill_len)
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, "config-Qwen3-0.6B.json", "all")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--paired", type=int, default=6, help="phase-paired rounds per server: the probe, "
                        "one request alone, the probe (default: 6; 0: none)")
    parser.add_argument("--prefill-len", type=int, default=2048, help="tokens of the long prompts whose time to "
                        "first token is measured (default: 2048; 0: none)")
    parser.add_argument("--prefill-rounds", type=int, default=3, help="long prompts per server (default: 3)")
    return peer_args(parser, argv)


def measure(args, model: str) -> tuple[dict, dict, dict]:
    """Each server alone: the streams' reports, the phase-paired rounds, the long prompts' TTFTs."""
    prompts = {n: random_prompts(n * args.rounds, args.input_len, args.seed) for n in args.streams}
    paired_prompts = random_prompts(args.paired, args.input_len, args.seed + 1)
    long_prompts = random_prompts(args.prefill_rounds if args.prefill_len else 0, args.prefill_len, args.seed + 2)
    results, paired, prefill = {}, {}, {}
    for name, command in commands(args, model).items():
        def then(base_url, name=name):
            if args.paired:
                print(f"int8: {name}, {args.paired} phase-paired rounds", file=sys.stderr, flush=True)
                paired[name] = paired_rounds(args, base_url, paired_prompts)
            if long_prompts:
                print(f"int8: {name}, {len(long_prompts)} prompts of {args.prefill_len} tokens", file=sys.stderr,
                      flush=True)
                prefill[name] = prefill_ttfts(args, base_url, long_prompts)
        try:
            results[name] = run_server(args, name, command, prompts, then)
        except RuntimeError as exc:  # one server that did not start or answer: still measure the others
            print(f"int8: {name} failed: {exc}", file=sys.stderr)
    return results, paired, prefill


def print_streams(args, results: dict, ceilings: dict) -> None:
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


def print_paired(args, config: dict, paired: dict) -> None:
    print(f"\nphase-paired, one stream ({args.paired} rounds each: the probe, one request alone, the probe): "
          f"decode rate (1 / ITL p50) over the ceiling of the round's own probes")
    for name, rounds in paired.items():
        fractions = of_ceiling(config, name, rounds)
        probes = [gb_s for gb_s, _ in rounds]
        print(f"  {name:<16} {statistics.median(fractions):.2f} of the {FORMATS[name][0]} ceiling "
              f"(rounds {min(fractions):.2f}-{max(fractions):.2f}; ITL p50 {statistics.median(itl for _, itl in rounds):.1f} ms; "
              f"probe {min(probes):.1f}-{max(probes):.1f} GB/s)")


def print_prefill(prefill: dict) -> None:
    print("\none long prompt alone: time to first token (s)")
    for name, timed in prefill.items():
        ttfts = [ttft for ttft, _ in timed]
        print(f"  {name:<16} median {statistics.median(ttfts):.2f}, best {min(ttfts):.2f} "
              f"(rounds {' '.join(f'{t:.2f}' for t in ttfts)}; {timed[0][1]} prompt tokens)")


def ratio(ours: float | None, peer: float | None) -> str:
    return f"{ours / peer:.2f}x" if ours and peer else "-"


def one_stream_line(results: dict, paired: dict, ours: str, peer: str, target: float) -> str:
    """One stream's tok/s ratio of two servers, and of their phase-paired decode rates per GB/s."""
    tok_s = ratio(results[ours][1].output_throughput, results[peer][1].output_throughput)
    rates = {name: statistics.median(1000 / itl / gb_s for gb_s, itl in paired[name])
             for name in (ours, peer) if name in paired}
    return (f"1 stream, {ours} / {peer}: {tok_s} tok/s, phase-paired decode rate per GB/s "
            f"{ratio(rates.get(ours), rates.get(peer))} (target {target}x)")


def many_streams_line(args, results: dict) -> str | None:
    """The most streams' tok/s, xserv's best server over llama.cpp's best, where both ran."""
    most = max(args.streams)
    speed = {side: max((r[most].output_throughput for name, r in results.items() if name.startswith(side)),
                       default=0.0) for side in ("xserv", "llama.cpp")}
    if most > 1 and all(speed.values()):
        return (f"{most} streams, xserv's best / llama.cpp's best: {ratio(speed['xserv'], speed['llama.cpp'])} "
                f"tok/s (target {MANY_STREAMS_TARGET}x)")
    return None


def print_targets(args, results: dict, paired: dict, prefill: dict) -> None:
    """The ratios the targets name, where both sides ran (at or above the target is met); beside
    the one-stream tok/s, the phase-paired decode rates per GB/s of each round's own probe, which
    hold each request to its minute."""
    def best_ttft(name: str) -> float:
        return min((ttft for ttft, _ in prefill.get(name, [])), default=0.0)

    lines = []
    for ours, peer, target in PAIRS:
        if 1 in args.streams and ours in results and peer in results:
            lines.append(one_stream_line(results, paired, ours, peer, target))
        if best_ttft(ours) and best_ttft(peer):
            lines.append(f"{args.prefill_len}-token prompt's TTFT, {peer} / {ours}: "
                         f"{ratio(best_ttft(peer), best_ttft(ours))} (target {PREFILL_TARGET}x)")
    lines += filter(None, [many_streams_line(args, results)])
    ttft = {side: min((best_ttft(name) for name in prefill if name.startswith(side)), default=0.0)
            for side in ("xserv", "llama.cpp")}
    if all(ttft.values()):
        lines.append(f"{args.prefill_len}-token prompt's TTFT, llama.cpp's best / xserv's best: "
                     f"{ratio(ttft['llama.cpp'], ttft['xserv'])} (target {PREFILL_TARGET}x)")
    if lines:
        print("\nagainst the targets (at or above the target is met)\n  " + "\n  ".join(lines))


def reports_json(results: dict, paired: dict) -> dict:
    """Every server's report per stream count and its phase-paired rounds, as --json writes them."""
    return ({f"{name} {n}": json.loads(report.to_json()) for name, r in results.items() for n, report in r.items()}
            | {f"{name} paired": [{"gb_s": gb_s, "itl_p50_ms": itl} for gb_s, itl in rounds]
               for name, rounds in paired.items()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu, model = start(args, "int8")
    config = json.loads((Path(model) / "config.json").read_text())
    bandwidth = read_bandwidth_gb_s()
    results, paired, prefill = measure(args, model)
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
    print_streams(args, results, ceilings)
    if paired:
        print_paired(args, config, paired)
    if prefill:
        print_prefill(prefill)
    print_targets(args, results, paired, prefill)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "model": model, "bandwidth_gb_s": bandwidth, "one_thread_gb_s": one_thread,
                       "ceilings": ceilings}
                      | reports_json(results, paired)
                      | {f"{name} prefill": [{"ttft_s": ttft, "prompt_tokens": tokens} for ttft, tokens in timed]
                         for name, timed in prefill.items()}, f, indent=2)
    return 0 if results else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("int8: interrupted; every server it started is stopped")

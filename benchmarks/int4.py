"""4-bit weights side by side: xserv `--quantization int4` against llama.cpp's Q4_K_M and Q4_0 and
xserv's own int8, on one random-weight checkpoint of a real Qwen3 shape, at 1 and 16 streams.

    python benchmarks/int4.py --llama-cpp-dir ../llamacpp/src --llama-server ../llamacpp/build/bin/llama-server \\
        --llama-quantize ../llamacpp/build/bin/llama-quantize --convert-python ../llamacpp/venv/bin/python
    python benchmarks/int4.py --config ../shared/reference/qwen3/config-Qwen3-8B.json --gguf-base q8_0 ...
    python benchmarks/int4.py --servers xserv-int4 xserv-int8            # xserv alone

The checkpoint (Qwen3-0.6B's shape by default, --config for another) is written once by
make_random_model.py into the user cache. llama.cpp's 4-bit GGUFs are made once beside it:
convert_hf_to_gguf.py writes the --gguf-base GGUF (bf16 by default; q8_0 where a bf16 GGUF beside
the bf16 checkpoint would not fit the disk, as for the 8B shape here: the 4-bit types are then
requantized from Q8_0's 8 bits, which moves their accuracy, not their speed), and
`llama-quantize --allow-requantize` makes Q4_K_M and Q4_0 from it. Each server then runs alone on
free 127.0.0.1 ports, one after the other, through the same load (`xserv bench`'s library, as
int8.py): --rounds requests per stream, ~190-token random prompts, 64 new tokens, greedy,
ignore_eos. While a server is still up, --paired rounds of the memory probe, one request alone,
the probe again (int8.py's phase-paired rounds): each round's decode rate (1 / its ITL p50) per
GB/s of its own probes, so two servers run minutes apart compare at their own minute's bandwidth.
The machine's load (/proc/loadavg) is recorded before and after each server: other work on the
cores moves these numbers. Last, the ratios the targets name.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import comparison_table, xserv_command  # noqa: E402
from int8 import (many_streams_line, one_stream_line, paired_rounds, read_bandwidth_gb_s,  # noqa: E402
                  reports_json)
from moe import add_peer_arguments, gguf, llama_server_command, peer_args, run_server, start  # noqa: E402
from xserv_cli.bench import random_prompts  # noqa: E402

SERVERS = ("xserv-int4", "llama.cpp-q4_k_m", "llama.cpp-q4_0", "xserv-int8")
# one stream: xserv int4's tok/s over each peer's, at least
ONE_STREAM_TARGETS = (("xserv-int4", "llama.cpp-q4_k_m", 1.2), ("xserv-int4", "xserv-int8", 1.4))
LLAMA_TYPES = {"llama.cpp-q4_k_m": "Q4_K_M", "llama.cpp-q4_0": "Q4_0"}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def quantized_gguf(args, model: str, qtype: str) -> str:
    """The `qtype` GGUF of `model` beside it, made once by llama-quantize from the --gguf-base GGUF."""
    path = Path(model).with_name(f"{Path(model).name}.{qtype.lower()}.gguf")
    if path.is_file():
        print(f"int4: using the GGUF {path}", file=sys.stderr)
        return str(path)
    base = gguf(args, model, args.gguf_base)
    partial = path.with_name(path.name + ".partial")
    command = [args.llama_quantize, "--allow-requantize", base, str(partial), qtype]
    print(f"int4: {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    partial.rename(path)
    return str(path)


def commands(args, model: str) -> dict:
    """server name -> a function of the port that gives its command line."""
    found = {}
    for name in args.servers:
        if name.startswith("xserv"):
            variant = argparse.Namespace(**{**vars(args), "xserv_args": f"{args.xserv_args} --quantization "
                                                                         f"{name.split('-')[1]}"})
            found[name] = lambda port, variant=variant: xserv_command(variant, port)
        elif args.llama_cpp_dir is None:
            print(f"int4: {name} skipped: no --llama-cpp-dir (its source tree, for convert_hf_to_gguf.py)",
                  file=sys.stderr)
        else:
            path = quantized_gguf(args, model, LLAMA_TYPES[name])
            found[name] = lambda port, path=path: llama_server_command(args, path, port)
    return found


def measure(args, model: str) -> tuple[dict, dict, dict]:
    """Each server alone: the streams' reports, the phase-paired rounds, the load before and after."""
    prompts = {n: random_prompts(n * args.rounds, args.input_len, args.seed) for n in args.streams}
    paired_prompts = random_prompts(args.paired, args.input_len, args.seed + 1)
    results, paired, loads = {}, {}, {}
    for name, command in commands(args, model).items():
        def then(base_url, name=name):
            if args.paired:
                print(f"int4: {name}, {args.paired} phase-paired rounds", file=sys.stderr, flush=True)
                paired[name] = paired_rounds(args, base_url, paired_prompts)
        before = load_average()
        try:
            results[name] = run_server(args, name, command, prompts, then)
        except RuntimeError as exc:  # one server that did not start or answer: still measure the others
            print(f"int4: {name} failed: {exc}", file=sys.stderr)
        loads[name] = (before, load_average())
        print(f"int4: {name} done, load average {loads[name][0]} before, {loads[name][1]} after",
              file=sys.stderr, flush=True)
    return results, paired, loads


def print_targets(args, results: dict, paired: dict) -> None:
    """The ratios the targets name, where both sides ran (at or above the target is met)."""
    lines = [one_stream_line(results, paired, ours, peer, target) for ours, peer, target in ONE_STREAM_TARGETS
             if 1 in args.streams and ours in results and peer in results]
    lines += filter(None, [many_streams_line(args, results)])
    if lines:
        print("\nagainst the targets (at or above the target is met)\n  " + "\n  ".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, "config-Qwen3-0.6B.json", "all")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--llama-quantize", default=None, help="llama-quantize binary (default: beside --llama-server)")
    parser.add_argument("--gguf-base", choices=("bf16", "q8_0"), default="bf16", help="the GGUF the converter writes "
                        "and llama-quantize makes the 4-bit ones from (default: bf16; q8_0 where disk is short)")
    parser.add_argument("--paired", type=int, default=4, help="phase-paired rounds per server: the probe, one "
                        "request alone, the probe (default: 4; 0: none)")
    args = peer_args(parser, argv)
    if args.llama_server and args.llama_quantize is None:
        args.llama_quantize = str(Path(args.llama_server).with_name("llama-quantize"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu, model = start(args, "int4")
    started = time.strftime("%Y-%m-%d %H:%M")
    results, paired, loads = measure(args, model)
    print(f"\n{Path(model).name}: {args.input_len}-token prompts, {args.output_len} new tokens, greedy, "
          f"{args.rounds} request(s) per stream, started {started}\nCPU: {cpu}\n"
          f"load average (1, 5, 15 min) before/after each server: "
          + "; ".join(f"{name} {b} / {a}" for name, (b, a) in loads.items()))
    for streams in args.streams:
        reports = {name: r[streams] for name, r in results.items() if streams in r}
        print(f"\n{streams} stream(s)\n" + comparison_table(reports))
    if paired:
        print("\nphase-paired, one stream: decode rate (1 / ITL p50) per GB/s of the round's own probes")
        for name, rounds in paired.items():
            per_gb = [1000 / itl / gb_s for gb_s, itl in rounds]
            print(f"  {name:<18} {statistics.median(per_gb):.3f} tok/s per GB/s (rounds {min(per_gb):.3f}-"
                  f"{max(per_gb):.3f}; ITL p50 {statistics.median(itl for _, itl in rounds):.1f} ms; probe "
                  f"{min(g for g, _ in rounds):.1f}-{max(g for g, _ in rounds):.1f} GB/s)")
    print_targets(args, results, paired)
    print(f"memory read bandwidth after the servers: {read_bandwidth_gb_s():.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "model": model, "started": started, "loads": loads}
                      | reports_json(results, paired), f, indent=2)
    return 0 if results else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("int4: interrupted; every server it started is stopped")

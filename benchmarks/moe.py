"""xserv vs llama.cpp's llama-server on one random-weight Qwen3-MoE checkpoint, at 1 and 16 streams.

    python benchmarks/moe.py --llama-cpp-dir ../llamacpp/src --llama-server ../llamacpp/build/bin/llama-server \\
        --convert-python ../llamacpp/venv/bin/python
    python benchmarks/moe.py                                     # xserv alone (llama.cpp skipped)
    python benchmarks/moe.py --config ../shared/reference/qwen3/config-Qwen3-0.6B.json   # a dense model
    python benchmarks/moe.py --config ../shared/reference/qwen3_5/config-Qwen3.5-35B-A3B.json   # a hybrid MoE

The checkpoint has Qwen3-30B-A3B's layer shape (128 experts of 768, 8 per token) and fewer layers
(--num-layers, default 8: about 11 GB in bf16, each layer's experts 1.2 GB). It is written once by
make_random_model.py into the user cache (or --model DIR) and converted once to a bf16 GGUF beside
it with llama.cpp's convert_hf_to_gguf.py. Then `xserv up` and llama-server run one after the
other on free 127.0.0.1 ports, each through the same load (compare.py's, i.e. `xserv bench`'s
library): --rounds requests per stream, ~190-token random prompts, 64 new tokens, greedy,
ignore_eos. Prints one table per stream count with both rows and their ratio, and the CPU.
With --passes N the servers run N times, in turns (xserv first, then llama.cpp first, ...), each
pass printed, then each stream count's ratios per pass and their median: this VM's read bandwidth
changes by the minute, and one pass can catch the two servers in different minutes.
Every process started here is stopped on the way out, Ctrl-C and errors included.
"""

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import bench, comparison_table, free_port, served, xserv_command  # noqa: E402
from make_random_model import is_hybrid, text_config, write_random_model  # noqa: E402
from xserv_cli.bench import random_prompts  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "qwen3"
MOE_LAYERS = 8  # default for an MoE config: ~11 GB in bf16, room for one server at a time on 24 GB


def cpu_description() -> str:
    """The CPU's model name, count, and whether it has the bf16 instructions the two engines may use."""
    info = Path("/proc/cpuinfo").read_text()

    def field(key: str) -> str:
        match = re.search(rf"^{key}\s*:\s*(.*)$", info, re.MULTILINE)
        return match.group(1) if match else "?"

    flags = set(field("flags").split())
    amx = sorted(flag for flag in flags if flag.startswith("amx"))
    return (f"{field('model name')} (family {field('cpu family')} model {field('model')}), {os.cpu_count()} CPUs; "
            f"avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}, "
            f"avx512_vnni {'yes' if 'avx512_vnni' in flags else 'no'}, amx {' '.join(amx) or 'no'}")


def checkpoint(args, vision: bool = False) -> str:
    """args.model if given and present; else the random checkpoint (with its vision tower: vision),
    written once (staged, then renamed)."""
    config = json.loads(Path(args.config).read_text())
    text = text_config(config)
    layers = args.num_layers or (MOE_LAYERS if text.get("num_experts") else text["num_hidden_layers"])
    if args.model is None:
        from xserv_engine.user_cache import user_cache_dir

        name = Path(args.config).stem.removeprefix("config-")
        tower = "-vision" if vision else ""
        args.model = str(user_cache_dir() / "bench" / f"{name}-{layers}layers{tower}-random")
    out = Path(args.model)
    if (out / "config.json").is_file():
        print(f"moe: using the checkpoint in {out}", file=sys.stderr)
        return str(out)
    print(f"moe: writing a random-weight {layers}-layer checkpoint of {args.config} to {out}", file=sys.stderr)
    staging = out.with_name(out.name + ".partial")
    write_random_model(args.config, staging, layers, args.seed, vision=vision)
    staging.rename(out)
    return str(out)


def gguf(args, model: str, outtype: str = "bf16", mmproj: bool = False) -> str:
    """The GGUF of `model` beside it (bf16, or q8_0: llama.cpp's 8-bit weights), converted once
    with llama.cpp's convert_hf_to_gguf.py (told that a Qwen3.5 comes without its mtp.* layer);
    mmproj: its vision tower's instead (llama-server's --mmproj)."""
    kind = "mmproj-" if mmproj else ""
    path = Path(model).with_name(Path(model).name + f".{kind}{outtype}.gguf")
    if path.is_file():
        print(f"moe: using the GGUF {path}", file=sys.stderr)
        return str(path)
    partial = path.with_name(path.name + ".partial")
    command = [args.convert_python, str(Path(args.llama_cpp_dir) / "convert_hf_to_gguf.py"), model,
               "--outtype", outtype, "--outfile", str(partial)]
    if mmproj:
        command.append("--mmproj")
    elif is_hybrid(json.loads((Path(model) / "config.json").read_text())):
        command.append("--no-mtp")
    print(f"moe: converting to GGUF: {shlex.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    partial.rename(path)
    return str(path)


def llama_server_command(args, gguf_path: str, port: int, longest_prompt: int = 0) -> list[str]:
    """llama-server with a slot per stream, each with room for the longer of --input-len and longest_prompt."""
    streams = max(args.streams)
    slot_tokens = max(args.input_len, longest_prompt) + args.output_len + 64  # room for the tokenizer's own few
    threads = str(os.cpu_count())
    return [args.llama_server, "--model", gguf_path, "--host", "127.0.0.1", "--port", str(port),
            "--alias", Path(gguf_path).stem, "--parallel", str(streams), "--ctx-size", str(streams * slot_tokens),
            "--threads", threads, "--threads-batch", threads, *shlex.split(args.llama_args)]


def servers(args, model: str) -> dict:
    """name -> a function of the port that gives its command line; llama.cpp only when it was given."""
    found = {} if args.only == "llama.cpp" else {"xserv": lambda port: xserv_command(args, port)}
    if args.only == "xserv":
        return found
    if args.llama_cpp_dir is None:
        print("moe: llama.cpp skipped: no --llama-cpp-dir (its source tree, for convert_hf_to_gguf.py)",
              file=sys.stderr)
    else:
        gguf_path = gguf(args, model)
        found["llama.cpp"] = lambda port: llama_server_command(args, gguf_path, port)
    return found


def run_server(args, name: str, command, prompts: dict[int, list[str]], then=None) -> dict:
    """Start one server, run every stream count through it, then `then(base_url)` if given, stop
    it; {streams: report}."""
    reports = {}
    port = free_port()
    with served(name, command(port), port, os.environ.copy(), args.ready_timeout) as base_url:
        for streams in args.streams:
            print(f"moe: {name}, {streams} stream(s), {len(prompts[streams])} requests", file=sys.stderr, flush=True)
            reports[streams] = bench(argparse.Namespace(**vars(args), concurrency=streams, request_rate=float("inf")),
                                     base_url, prompts[streams], ignore_eos=True)
        if then is not None:
            then(base_url)
    return reports


def add_checkpoint_arguments(parser: argparse.ArgumentParser, config: Path, num_layers_help: str) -> None:
    """The flags of a side-by-side run's checkpoint and of llama.cpp's build and converter."""
    parser.add_argument("--config", default=str(config), help=f"the config.json whose shape to write "
                        f"(default: {config.name})")
    parser.add_argument("--num-layers", type=int, default=None, help=f"decoder layers to keep (default: {num_layers_help})")
    parser.add_argument("--model", default=None, help="checkpoint directory; written there when absent "
                        "(default: one per config and layer count in the user cache)")
    parser.add_argument("--llama-cpp-dir", default=None, help="llama.cpp source tree (convert_hf_to_gguf.py); "
                        "without it llama.cpp is skipped")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (default: LLAMA_CPP_DIR/build/bin/)")
    parser.add_argument("--convert-python", default=sys.executable,
                        help="python for the converter, with gguf, numpy, torch, transformers (default: this one)")


def add_peer_arguments(parser: argparse.ArgumentParser, config: str, num_layers_help: str) -> None:
    """The flags of a side-by-side run against llama.cpp (this script's and int8.py's): the
    checkpoint's shape, llama.cpp's build and converter, the load, the servers' extra flags."""
    add_checkpoint_arguments(parser, REFERENCE / config, num_layers_help)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16], help="concurrent streams (default: 1 16)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream (default: 2)")
    parser.add_argument("--input-len", type=int, default=190, help="prompt tokens (default: 190)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    parser.add_argument("--xserv-args", default="--device cpu", help="extra `xserv up` flags, one string")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags, one string")
    parser.add_argument("--json", metavar="PATH", default=None, help="write every report as JSON")


def peer_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.llama_cpp_dir and args.llama_server is None:
        args.llama_server = str(Path(args.llama_cpp_dir) / "build" / "bin" / "llama-server")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, "config-Qwen3-30B-A3B.json", f"{MOE_LAYERS} for an MoE config, else all")
    parser.add_argument("--only", choices=("xserv", "llama.cpp"), default=None, help="run one server")
    parser.add_argument("--passes", type=int, default=1, help="run the servers this many times, in turns, and "
                        "print the median of the ratios too (default: 1)")
    return peer_args(parser, argv)


def start(args, script: str, vision: bool = False) -> tuple[str, str]:
    """A side-by-side run's first steps: Ctrl-C and SIGTERM made to stop the servers, the CPU
    (printed), the checkpoint (with its vision tower: vision); (CPU, checkpoint directory)."""
    # run the finally blocks that stop the servers, also when started with SIGINT ignored (`cmd &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cpu = cpu_description()
    print(f"{script}: CPU: {cpu}", file=sys.stderr)
    return cpu, checkpoint(args, vision)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu, model = start(args, "moe")
    prompts = {n: random_prompts(n * args.rounds, args.input_len, args.seed) for n in args.streams}
    named = servers(args, model)
    passes = []  # each pass's {server: {streams: report}}
    for p in range(max(1, args.passes)):
        order = list(named.items()) if p % 2 == 0 else list(reversed(named.items()))
        results = {}
        for name, command in order:
            try:
                results[name] = run_server(args, name, command, prompts)
            except RuntimeError as exc:  # one server that did not start or answer: still measure the other
                print(f"moe: {name} failed: {exc}", file=sys.stderr)
        passes.append({name: results[name] for name in named if name in results})
    print(f"\n{Path(model).name}: {args.input_len}-token prompts, {args.output_len} new tokens, greedy, "
          f"{args.rounds} request(s) per stream\nCPU: {cpu}")
    for i, results in enumerate(passes):
        if len(passes) > 1:
            print(f"\npass {i + 1} of {len(passes)}" + (" (llama.cpp first)" if i % 2 else ""))
        for streams in args.streams:
            print(f"\n{streams} stream(s)\n" + comparison_table({name: r[streams] for name, r in results.items()}))
    both = [r for r in passes if len(r) == 2]
    if len(both) > 1:
        print(f"\nxserv / llama.cpp over {len(both)} passes (tok/s: above 1 favours xserv; ITL p50: below 1)")
        for streams in args.streams:
            speed = [r["xserv"][streams].output_throughput / r["llama.cpp"][streams].output_throughput for r in both]
            itl = [r["xserv"][streams].itl_ms.p50 / r["llama.cpp"][streams].itl_ms.p50 for r in both]
            print(f"{streams} stream(s): tok/s {' '.join(f'{x:.2f}x' for x in speed)}, median "
                  f"{statistics.median(speed):.2f}x; ITL p50 {' '.join(f'{x:.2f}x' for x in itl)}, median "
                  f"{statistics.median(itl):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "model": model} | {f"{name} {n} pass {i + 1}": json.loads(report.to_json())
                                                       for i, results in enumerate(passes)
                                                       for name, r in results.items() for n, report in r.items()},
                      f, indent=2)
    return 0 if any(passes) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("moe: interrupted; every server it started is stopped")

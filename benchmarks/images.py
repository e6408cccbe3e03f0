"""Images side by side: xserv against llama.cpp's `llama-server --mmproj` on the same random weights
(the Qwen3.5-0.8B shape with its vision tower, bf16), one 1024 x 768 image and a short question:
the time to first token of one stream and the tokens/s of 8 concurrent image requests.

    .venv/bin/python benchmarks/images.py --llama-cpp-dir ../llamacpp/src \\
        --llama-server ../llamacpp/build/bin/llama-server --convert-python ../llamacpp/venv/bin/python
    .venv/bin/python benchmarks/images.py --only xserv     # xserv alone

The checkpoint is written once by make_random_model.py --vision into the user cache
(~/.cache/xserv/bench/Qwen3.5-0.8B-24layers-vision-random); llama.cpp's converter
(convert_hf_to_gguf.py) writes beside it, once, a bf16 GGUF of the text model (--no-mtp) and a
bf16 GGUF of the vision tower (--mmproj). Each server then runs alone on free 127.0.0.1 ports, one
after the other (`xserv up --dtype bfloat16`, then llama-server --mmproj --jinja with a slot per
stream and a thread per CPU), and gets the same requests: a user message of one PNG image as a
data: URL and a short question, streamed through /v1/chat/completions at temperature 0 with
ignore_eos. The images are deterministic (a colour gradient under seeded noise, the same bytes to
both servers) and every request's image is new to the server, so neither xserv's encoder cache
nor either server's prompt cache holds it: each TTFT counts decoding the PNG, preprocessing, the
vision encoder and the prefill.

  - warm-up: one image request per server, not measured;
  - 1 stream: --rounds requests one after the other, each with a fresh image; TTFT best and median;
  - --streams (8) concurrent: as many requests at once, each with its own image and --max-tokens
    new tokens; output tokens/s over the wall time from the first request sent to the last
    finished, and those requests' TTFT median.

Prints the CPU, the load average (1 minute) before and after each server (the machine may be
shared: compare with care), a table with each server's prompt tokens (the image's tokens as that
server counts them), and the ratios the issue sets targets for: xserv's TTFT at most 0.5x
llama.cpp's (median), xserv's tokens/s at 8 streams at least 2x.
"""

import argparse
import base64
import io
import json
import os
import shlex
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, served, xserv_command  # noqa: E402
from moe import REFERENCE, add_checkpoint_arguments, gguf, peer_args, start  # noqa: E402
from multi_turn_servers import Turn, chat  # noqa: E402

QUESTION = "What is in this picture? Answer in one sentence."
TTFT_TARGET = 0.5  # xserv's median TTFT over llama.cpp's, at most
STREAMS_TARGET = 2.0  # xserv's tok/s at --streams over llama.cpp's, at least


def image_png(width: int, height: int, seed: int) -> bytes:
    """A colour gradient under seeded noise, PNG-encoded: the same bytes for the same arguments."""
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, 2 * np.pi, 3)
    channels = [127 + 100 * np.sin(2 * np.pi * (x / width + y / height) + p) for p in phase]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 20, (height, width, 3))
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def image_message(png: bytes, question: str) -> list[dict]:
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                         {"type": "text", "text": question}]}]


class Images:
    """Fresh images, one per request, never the same twice in a run."""

    def __init__(self, args):
        self.width, self.height, self.next_seed = args.width, args.height, args.seed

    def take(self, count: int) -> list[bytes]:
        seeds = range(self.next_seed, self.next_seed + count)
        self.next_seed += count
        return [image_png(self.width, self.height, seed) for seed in seeds]


def ask(base_url: str, model: str, png: bytes, args) -> Turn:
    try:
        turn, _ = chat(base_url, model, image_message(png, args.question), args.max_tokens)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base_url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
    return turn


def measure(base_url: str, args, ttft_images: list[bytes], stream_images: list[bytes], warm_image: bytes) -> dict:
    """One server: the warm-up, the 1-stream TTFTs, then --streams requests at once."""
    with urllib.request.urlopen(base_url + "/models", timeout=10) as resp:
        model = json.load(resp)["data"][0]["id"]
    ask(base_url, model, warm_image, args)
    one = [ask(base_url, model, png, args) for png in ttft_images]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(stream_images)) as pool:
        many = list(pool.map(lambda png: ask(base_url, model, png, args), stream_images))
    wall = time.perf_counter() - start
    return {"ttft_s": [t.ttft_s for t in one], "prompt_tokens": one[0].prompt_tokens,
            "cached_tokens": sum(t.cached_tokens for t in one),
            "streams_tok_s": sum(t.completion_tokens for t in many) / wall,
            "streams_completion_tokens": [t.completion_tokens for t in many],
            "streams_ttft_s": [t.ttft_s for t in many], "streams_wall_s": wall}


def llama_server_command(args, model_gguf: str, mmproj_gguf: str, port: int) -> list[str]:
    threads = str(os.cpu_count())
    return [args.llama_server, "--model", model_gguf, "--mmproj", mmproj_gguf, "--host", "127.0.0.1",
            "--port", str(port), "--alias", Path(model_gguf).stem, "--jinja", "--parallel", str(args.streams),
            "--ctx-size", str(args.streams * args.slot_tokens), "--threads", threads, "--threads-batch", threads,
            *shlex.split(args.llama_args)]


def servers(args, model: str) -> dict:
    """name -> a function of the port that gives its command line."""
    found = {} if args.only == "llama.cpp" else {"xserv": lambda port: xserv_command(args, port)}
    if args.only == "xserv":
        return found
    if args.llama_cpp_dir is None or args.llama_server is None:
        print("images: llama.cpp skipped: give --llama-cpp-dir and --llama-server", file=sys.stderr)
        return found
    model_gguf, mmproj_gguf = gguf(args, model), gguf(args, model, mmproj=True)
    found["llama.cpp"] = lambda port: llama_server_command(args, model_gguf, mmproj_gguf, port)
    return found


def run(args, model: str) -> dict:
    """Each server alone, on the same images: name -> its numbers and the load around its run."""
    images = Images(args)
    warm, ttft, streams = images.take(1), images.take(args.rounds), images.take(args.streams)
    results = {}
    for name, command in servers(args, model).items():
        port = free_port()
        with served(name, command(port), port, os.environ.copy(), args.ready_timeout) as base_url:
            load_before = os.getloadavg()[0]
            print(f"images: {name}: {args.rounds} single requests, then {args.streams} at once", file=sys.stderr,
                  flush=True)
            results[name] = measure(base_url, args, ttft, streams, warm[0])
            results[name]["load"] = (load_before, os.getloadavg()[0])
    return results


def table(results: dict, streams: int) -> list[str]:
    lines = [f"| server | prompt tokens | TTFT 1 stream, best ms | TTFT 1 stream, median ms | {streams} streams tok/s "
             f"| {streams} streams TTFT p50 ms | load avg before / after |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['prompt_tokens']} | {min(r['ttft_s']) * 1e3:.0f} "
                     f"| {statistics.median(r['ttft_s']) * 1e3:.0f} | {r['streams_tok_s']:.1f} "
                     f"| {statistics.median(r['streams_ttft_s']) * 1e3:.0f} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    return lines


def ratios(results: dict, streams: int) -> list[str]:
    if not {"xserv", "llama.cpp"} <= results.keys():
        return []
    x, ref = results["xserv"], results["llama.cpp"]
    ttft = statistics.median(x["ttft_s"]) / statistics.median(ref["ttft_s"])
    best = min(x["ttft_s"]) / min(ref["ttft_s"])
    speed = x["streams_tok_s"] / ref["streams_tok_s"]
    return [f"  TTFT at 1 stream, xserv / llama.cpp: {ttft:.2f}x median, {best:.2f}x best "
            f"(target at most {TTFT_TARGET}x: {'met' if ttft <= TTFT_TARGET else 'missed'})",
            f"  {streams} streams tok/s, xserv / llama.cpp: {speed:.2f}x "
            f"(target at least {STREAMS_TARGET}x: {'met' if speed >= STREAMS_TARGET else 'missed'})"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser, REFERENCE.parent / "qwen3_5" / "config-Qwen3.5-0.8B.json", "all")
    parser.add_argument("--only", choices=("xserv", "llama.cpp"), default=None, help="run one server")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--rounds", type=int, default=3, help="single requests timed for the TTFT (default: 3)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent image requests (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default: 32)")
    parser.add_argument("--slot-tokens", type=int, default=4096, help="llama.cpp's context per slot (default: 4096)")
    parser.add_argument("--seed", type=int, default=0, help="the first image's; each request's is one more")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    parser.add_argument("--xserv-args", default="--device cpu", help="extra `xserv up` flags, one string")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags, one string")
    parser.add_argument("--json", metavar="PATH", default=None, help="write every server's numbers as JSON")
    return peer_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu, model = start(args, "images", vision=True)
    results = run(args, model)
    print(f"\nimages: {Path(model).name}, bf16; one {args.width}x{args.height} PNG + {args.question!r}, "
          f"{args.max_tokens} new tokens (ignore_eos), a fresh image per request\nCPU: {cpu}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; command: {shlex.join(sys.argv)}")
    print("\n".join(table(results, args.streams) + ratios(results, args.streams)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

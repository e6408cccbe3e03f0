"""What the REST hop costs: the same streamed completions through the REST front (SSE) and
straight to the engine (gRPC), at 1 and 64 concurrent streams, in one run.

    python benchmarks/rest_overhead.py                       # starts `xserv up` on the demo model
    python benchmarks/rest_overhead.py --url http://127.0.0.1:8000 --grpc 127.0.0.1:50051
    python benchmarks/rest_overhead.py --concurrency 1 --rounds 10 --max-tokens 128 --ceiling

Prints a table: output tokens/s over the whole run, time to first token (p50, p90) and, when
the script started `xserv up` itself, the CPU seconds the REST front's processes spent. With
--ceiling (on the demo model or `-- --model PATH`, default dtype) it also times the batch-1
LM-head matmul in this process between the rounds, while the server idles (this machine's speed
drifts within minutes), and prints one stream through REST as a fraction of that ceiling: of the
median of those samples and of the best one, for torch's matmuls and for the fastest LM head
there is (roofline.py).
"""

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import requests

from xserv.v1 import engine_pb2, engine_pb2_grpc

PROMPT = "Write a short story about a lighthouse keeper."


def rest_stream(url: str, model: str, max_tokens: int, session: requests.Session) -> tuple[float, int]:
    """(seconds to the first text, output tokens) for one streamed completion over REST."""
    start = time.perf_counter()
    ttft = None
    tokens = 0
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with session.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["text"]:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens


def grpc_stream(stub, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    ttft = None
    tokens = 0
    request = engine_pb2.GenerateRequest(text=PROMPT, params=engine_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    for message in stub.Generate(request, timeout=600):
        if ttft is None and message.text:
            ttft = time.perf_counter() - start
        tokens += len(message.token_ids)
    return ttft, tokens


def measure(one, concurrency: int, requests_total: int) -> tuple[list[tuple[float, int]], float]:
    """Run `requests_total` calls of `one`, `concurrency` at a time: ((ttft, tokens) each, wall s)."""
    local = threading.local()
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda _: one(local), range(requests_total)))
    return results, time.perf_counter() - start


def summary(results: list[tuple[float, int]], wall: float) -> dict:
    ttfts = sorted(r[0] for r in results)
    return {"tok_s": sum(r[1] for r in results) / wall, "req_s": len(results) / wall,
            "ttft_p50": statistics.median(ttfts) * 1000,
            "ttft_p90": ttfts[math.ceil(0.9 * len(ttfts)) - 1] * 1000}


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []
    return [pid] + [d for c in children for d in process_tree(c)]


def front_pids(up_pid: int) -> list[int]:
    """The `xserv rest` process and its gunicorn workers, under a running `xserv up`: the child
    that is not the engine (gunicorn renames its processes, so the front's cmdline is not its own)."""
    with open(f"/proc/{up_pid}/task/{up_pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"\0engine\0" not in f.read():
                return process_tree(pid)
    return []


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of these processes onto `cpus` (threads they start later inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_up(extra: list[str], cpus: set[int] | None = None) -> tuple[subprocess.Popen, str, str]:
    """`xserv up` on free ports; with `cpus`, it starts (and its engine's torch threads are sized) there."""
    port, grpc_port = free_port(), free_port()
    process = subprocess.Popen([sys.executable, "-m", "xserv_cli", "up", "--port", str(port),
                                "--grpc-port", str(grpc_port), "--log-level", "warning", *extra],
                               preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("xserv up exited")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=1).status == 200:
                return process, url, f"127.0.0.1:{grpc_port}"
        except OSError:
            time.sleep(0.5)
    raise SystemExit("xserv up did not become healthy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="REST front of a running xserv (default: start `xserv up`)")
    parser.add_argument("--grpc", help="its engine's HOST:PORT")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream slot (default: 2)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also print 1 stream through REST against the batch-1 LM-head ceiling")
    parser.add_argument("up_args", nargs="*", help="extra `xserv up` flags (after --)")
    args = parser.parse_args()
    process = None
    if args.url is None:
        process, args.url, args.grpc = start_up(args.up_args)
    try:
        run(args, front_pids(process.pid) if process else [])
    finally:
        if process is not None:
            process.terminate()
            process.wait()
    return 0


def run(args, front: list[int]) -> None:
    model = requests.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    channel = grpc.insecure_channel(args.grpc)
    stub = engine_pb2_grpc.EngineServiceStub(channel)

    def via_rest(local):
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return rest_stream(args.url, model, args.max_tokens, local.session)

    paths = {"REST (SSE)": via_rest, "gRPC direct": lambda local: grpc_stream(stub, args.max_tokens)}
    print(f"model {model}, {args.max_tokens} output tokens per request, prompt {PROMPT!r}")
    ceiling = Ceiling(args.up_args) if args.ceiling and 1 in args.concurrency else None
    rows = report(paths, args.concurrency, args.rounds, {"REST (SSE)": front},
                  between_rounds=ceiling.sample if ceiling else None)
    channel.close()
    if ceiling:
        ceiling.print(rows[("REST (SSE)", 1)]["tok_s"])


class Ceiling:
    """The batch-1 LM-head matmul of the served model and dtype, timed in this process between
    the rounds of the one-stream rows."""

    def __init__(self, up_args: list[str]):
        from xserv_engine.openmp import wait_briefly

        # as the engine's: with libgomp's default, this process's OpenMP threads would spin for
        # milliseconds after each sample, on the cores the next round's server needs
        wait_briefly()
        import torch  # only here: the rest of the script is a client

        from roofline import LMHead  # benchmarks/roofline.py
        from xserv_engine.demo import default_model_dir
        from xserv_engine.engine.device import resolve_dtype

        flags = dict(zip(up_args[::2], up_args[1::2]))
        model = flags.get("--model") or str(default_model_dir())
        self.dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[
            resolve_dtype(flags.get("--dtype", "auto"), torch.device("cpu"))]
        self.head = LMHead(model, self.dtype, 1)
        self.samples: list[float] = []

    def sample(self, concurrency: int) -> None:
        if concurrency == 1:
            self.samples.append(self.head.tok_s_by_head(rounds=2, repeats=10))

    def print(self, rest_tok_s: float) -> None:
        """Against the ceiling of torch's matmuls (F.linear, oneDNN's packed linear: the one issue
        17 set the target against), the LM head a one-stream step runs."""
        print(f"\none stream through REST: {rest_tok_s:.1f} tok/s; the batch-1 LM-head ceiling ({self.dtype}) timed "
              f"{len(self.samples)} times between the rounds while the server idled:")
        for label in ("torch's matmul",):
            tok_s = [max(sample.values()) for sample in self.samples]
            median, best = statistics.median(tok_s), max(tok_s)
            print(f"  {label}: median {median:.1f} tok/s (range {min(tok_s):.1f}-{best:.1f}): "
                  f"{rest_tok_s / median:.2f} of the median, {rest_tok_s / best:.2f} of the best")


def report(paths: dict, concurrencies: list[int], rounds: int, fronts: dict[str, list[int]],
           between_rounds=None) -> dict:
    """Warm every path up, then print one table row per concurrency and path; `fronts` names the
    processes whose CPU seconds each path's row reports; returns each row's numbers by (path,
    concurrency); between_rounds(concurrency), if given, runs after each round. The paths take
    turns round by round
    (each round: `concurrency` requests at once), so a change in the machine's load during the
    run falls on all of them alike."""
    for one in paths.values():  # (and every gunicorn worker's gRPC channel)
        measure(one, 8, 8)
    print("| path | streams | requests | output tok/s | req/s | TTFT p50 ms | TTFT p90 ms | front CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for concurrency in concurrencies:
        results = {name: [] for name in paths}
        wall = dict.fromkeys(paths, 0.0)
        cpu = dict.fromkeys(paths, 0.0)
        for _ in range(rounds):
            for name, one in paths.items():
                pids = fronts.get(name, [])
                cpu_before = cpu_seconds(pids)
                done, seconds = measure(one, concurrency, concurrency)
                results[name] += done
                wall[name] += seconds
                cpu[name] += cpu_seconds(pids) - cpu_before
            if between_rounds:
                between_rounds(concurrency)
        for name in paths:
            r = rows[(name, concurrency)] = summary(results[name], wall[name])
            cpu_s = f"{cpu[name]:.2f}" if fronts.get(name) else "n/a"
            print(f"| {name} | {concurrency} | {len(results[name])} | {r['tok_s']:.0f} | {r['req_s']:.2f} | "
                  f"{r['ttft_p50']:.1f} | {r['ttft_p90']:.1f} | {cpu_s} |", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())

"""xserv vs transformers serve (continuous batching) under the same load, on the same model.

    python benchmarks/compare.py                       # the demo model, 128 requests at concurrency 64
    python benchmarks/compare.py --model DIR --num-requests 64 --concurrency 16 --xserv-args "--device cpu"

Starts `xserv up`, runs the load through `xserv bench`'s library, stops it; then the same for
`transformers serve --continuous-batching` (HF_HUB_OFFLINE=1, bf16, the model as a local path);
then prints both rows and their ratios. Both get identical prompts (same seed) and bodies.
transformers serve rejects unknown fields, so ignore_eos is not sent to either: each request
runs to max_tokens unless the model samples an end-of-sequence token (the table shows output
tokens per request). transformers serve needs `transformers[serving]` (fastapi, uvicorn, ...);
--peer-pythonpath DIR adds a directory where they were installed with `pip install --target`.
Every process started here is stopped on the way out, Ctrl-C and errors included.
"""

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from xserv_cli.bench import BenchConfig, Report, format_report, random_prompts, run_benchmark
from xserv_cli.bench.client import send_request
from xserv_cli.bench.cli import first_model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def xserv_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "xserv_cli", "up", "--model", args.model, "--port", str(port),
            "--grpc-port", str(free_port()), "--dtype", "bfloat16", "--log-level", "warning",
            *shlex.split(args.xserv_args)]


def transformers_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", "--continuous-batching",
            "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            *shlex.split(args.transformers_args), args.model]


@contextlib.contextmanager
def served(name: str, command: list[str], port: int, env: dict, ready_timeout_s: float):
    """Run a server in a process group of its own until healthy; yield its /v1 URL; stop it."""
    log = tempfile.NamedTemporaryFile(prefix=f"compare-{name.split()[0]}-", suffix=".log", delete=False)
    print(f"starting {name}: {shlex.join(command)}  (log: {log.name})", file=sys.stderr)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, ready_timeout_s, log.name)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(process)
        log.close()


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with code {process.returncode} before it was healthy; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not healthy after {timeout_s:.0f}s; see {log_path}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the whole group; SIGKILL what is left after 60 s (or at once on a second Ctrl-C)."""
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # and stragglers in the group (e.g. workers)
        process.wait()


def bench_config(args, base_url: str, ignore_eos: bool = False) -> BenchConfig:
    """The load of `args` (endpoint, output_len, concurrency, request_rate, timeout, seed) at base_url."""
    return BenchConfig(base_url=base_url, model=first_model(base_url, None), endpoint=args.endpoint,
                       output_len=args.output_len, concurrency=args.concurrency,
                       request_rate=args.request_rate, ignore_eos=ignore_eos, timeout_s=args.timeout,
                       seed=args.seed)


def bench(args, base_url: str, prompts: list[str], ignore_eos: bool = False) -> Report:
    """One warm-up request, then the clocked run. ignore_eos (vLLM's field) only for servers that accept it."""
    config = bench_config(args, base_url, ignore_eos)
    # unclocked: checks the endpoint and warms it up, with a prompt of its own: warmed with
    # prompts[0], the first clocked request would be a prefix-cache hit on every server
    warmup = random_prompts(1, args.input_len, args.seed + 1)[0]
    check = send_request(config, warmup)
    if not check.ok:
        raise RuntimeError(f"first request to {base_url} failed ({check.error_kind}): {check.error}")
    report = run_benchmark(config, prompts, args.input_len)
    print(format_report(report) + "\n", flush=True)
    return report


COLUMNS = (  # header, value, format
    ("done/failed", lambda r: f"{r.completed}/{r.failed}", None),
    ("out tok/req", lambda r: r.output_tokens / max(r.completed, 1), ".1f"),
    ("out tok/s", lambda r: r.output_throughput, ".1f"),
    ("TTFT p50 ms", lambda r: r.ttft_ms.p50, ".0f"),
    ("TTFT p99 ms", lambda r: r.ttft_ms.p99, ".0f"),
    ("ITL p50 ms", lambda r: r.itl_ms.p50, ".1f"),
    ("E2E p50 ms", lambda r: r.e2e_ms.p50, ".0f"),
)


def comparison_table(reports: dict[str, Report]) -> str:
    lines = [f"{'':<22}" + "".join(f"{h:>13}" for h, _, _ in COLUMNS)]
    for name, report in reports.items():
        lines.append(f"{name:<22}" + "".join(f"{v(report) if f is None else format(v(report), f):>13}"
                                              for _, v, f in COLUMNS))
    if len(reports) == 2:
        (a, ra), (b, rb) = reports.items()
        ratios = [f"{v(ra) / v(rb):.2f}x" if f and v(rb) else "" for _, v, f in COLUMNS]
        lines.append(f"{a + ' / ' + b:<22}" + "".join(f"{x:>13}" for x in ratios))
        lines.append("(ratios: above 1 favours the first for tok/s, below 1 for latencies)")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: xserv's demo model)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    parser.add_argument("--xserv-args", default="", help="extra `xserv up` flags, one string")
    parser.add_argument("--transformers-args", default="", help="extra `transformers serve` flags, one string")
    parser.add_argument("--peer-pythonpath", default=None, help="prepended to PYTHONPATH for transformers serve")
    parser.add_argument("--only", choices=("xserv", "transformers"), default=None, help="run one server")
    parser.add_argument("--json", metavar="PATH", default=None, help="write both reports as JSON")
    parser.add_argument("--no-roofline", action="store_true", help="skip the LM-head roofline measurement")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.model is None:
        from xserv_engine.demo import default_model_dir  # builds it once; imports torch, hence here

        args.model = default_model_dir()
    # run the finally blocks that stop the servers, also when started with SIGINT ignored (`cmd &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    peer_env = os.environ | {"HF_HUB_OFFLINE": "1"}
    if args.peer_pythonpath:
        peer_env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.peer_pythonpath, os.environ.get("PYTHONPATH")]))
    servers = {"xserv": (xserv_command, os.environ.copy()), "transformers serve": (transformers_command, peer_env)}
    prompts = random_prompts(args.num_requests, args.input_len, args.seed)
    reports = {}
    for name, (command, env) in servers.items():
        if args.only and not name.startswith(args.only):
            continue
        port = free_port()
        with served(name, command(args, port), port, env, args.ready_timeout) as base_url:
            reports[name] = bench(args, base_url, prompts)
    print(comparison_table(reports))
    roofline = None
    if "xserv" in reports and not args.no_roofline:
        from roofline import lm_head_roofline  # benchmarks/roofline.py; imports torch, hence here

        batch = min(args.concurrency, args.num_requests)
        roofline = lm_head_roofline(args.model, "bfloat16", batch)
        print(f"xserv / LM-head roofline at batch {batch}: {reports['xserv'].output_throughput:.0f} / "
              f"{roofline:.0f} tok/s = {reports['xserv'].output_throughput / roofline:.2f} "
              "(the roofline times the bf16 [batch, hidden] x [hidden, vocab] matmul alone, measured "
              "here after both servers stopped)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: json.loads(r.to_json()) for name, r in reports.items()}
                      | {"lm_head_roofline_tok_s": roofline}, f, indent=2)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("compare: interrupted; every server it started is stopped")
    except RuntimeError as exc:  # a server that did not start or answer
        sys.exit(f"compare: {exc}")

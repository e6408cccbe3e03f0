"""What the SGLang Model Gateway hop costs: the same streamed completions through SMG (gRPC mode,
SSE), through xserv's own REST front (SSE) and straight to the engine (gRPC), at 1 and 64
concurrent streams, in one run, on one engine.

    python benchmarks/smg_overhead.py             # starts `xserv up` (demo model) and `smg launch`
    python benchmarks/smg_overhead.py -- --model PATH
    python benchmarks/smg_overhead.py --split-cores   # engine on CPU 0; fronts and client on the rest

SMG is meant to run on its own host. --split-cores is the nearest this script can get on one
machine: the engine alone on CPU 0 (its torch threads sized to it), and SMG, the REST front and
this client on the other CPUs, so neither front's CPU comes out of the engine's.

SMG tokenizes and detokenizes itself and speaks SMG's worker protocol to the engine's port;
the REST front sends text and gets text. The measuring code is rest_overhead.py's. Prints a
table: output tokens/s over the run, TTFT p50 / p90, and the CPU seconds each front spent.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rest_overhead import PROMPT, free_port, front_pids, grpc_stream, pin, report, rest_stream, start_up  # noqa: E402
from xserv.v1 import engine_pb2_grpc  # noqa: E402

SMG = str(Path(sys.executable).parent / "smg")


def start_smg(engine: str, cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
                                "--prometheus-port", str(free_port()), "--worker-urls", f"grpc://{engine}",
                                "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/v1/tokenizers", timeout=1).json()["tokenizers"]:
                return process, url
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("smg did not load the model's tokenizer")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream slot (default: 2)")
    parser.add_argument("--split-cores", action="store_true",
                        help="engine on CPU 0, SMG, the REST front and this client on the other CPUs")
    parser.add_argument("up_args", nargs="*", help="extra `xserv up` flags (after --)")
    args = parser.parse_args()
    engine_cpus = fronts_cpus = None
    if args.split_cores:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--split-cores needs at least 2 CPUs")
        engine_cpus, fronts_cpus = {cpus[0]}, set(cpus[1:])
        print(f"engine on CPU {cpus[0]}; SMG, the REST front and this client on CPUs {sorted(fronts_cpus)}")
    up, rest_url, engine = start_up(args.up_args, engine_cpus)
    smg = None
    try:
        rest_front = front_pids(up.pid)
        if fronts_cpus is not None:
            pin(rest_front, fronts_cpus)
            os.sched_setaffinity(0, fronts_cpus)
        smg, smg_url = start_smg(engine, fronts_cpus)
        run(args, rest_url, smg_url, engine, {"SMG (SSE)": [smg.pid], "REST (SSE)": rest_front})
    finally:
        for process in (smg, up):
            if process is not None:
                process.terminate()
                process.wait()
    return 0


def run(args, rest_url: str, smg_url: str, engine: str, fronts: dict[str, list[int]]) -> None:
    model = requests.get(f"{rest_url}/v1/models").json()["data"][0]["id"]
    channel = grpc.insecure_channel(engine)
    stub = engine_pb2_grpc.EngineServiceStub(channel)

    def over_http(url):
        def one(local):
            if not hasattr(local, "session"):
                local.session = requests.Session()
            return rest_stream(url, model, args.max_tokens, local.session)
        return one

    paths = {"SMG (SSE)": over_http(smg_url), "REST (SSE)": over_http(rest_url),
             "gRPC direct": lambda local: grpc_stream(stub, args.max_tokens)}
    print(f"model {model}, {args.max_tokens} output tokens per request, prompt {PROMPT!r}")
    report(paths, args.concurrency, args.rounds, fronts)
    channel.close()


if __name__ == "__main__":
    sys.exit(main())

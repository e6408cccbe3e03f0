"""What the gRPC hop costs: the same workload on an in-process LLMEngine and through a real
`xserv engine` process on loopback, in one run, at 1 and 64 concurrent streams.

    .venv/bin/python benchmarks/grpc_overhead.py [--concurrency 1 64] [--max-tokens 64] \
        [-- ENGINE FLAGS, e.g. --model PATH --device cuda]

Every stream asks for max_tokens greedy tokens with ignore_eos, so both paths generate exactly
the same number of tokens. Output tok/s counts every stream's tokens over the wall time from the
first request to the last finish; TTFT is request sent -> first token received; CPU ms per token is the CPU
time every process of the path spent in the run (the benchmark's own, and the server's for gRPC:
the hop's cost whatever else the machine does) over the tokens. Each point is the median of
--repeat runs.
"""

import argparse
import asyncio
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xserv.v1 import engine_pb2, engine_pb2_grpc

from xserv_engine.engine.engine_thread import Mailbox
from xserv_engine.openmp import wait_briefly
from xserv_engine.outputs import coalesce
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.server import cli as engine_cli

from rest_overhead import cpu_seconds  # benchmarks/rest_overhead.py

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ENGINE_FLAGS = ["--num-kv-blocks", "2048", "--max-model-len", "1024", "--max-num-seqs", "128"]


@dataclass
class Result:
    streams: int
    tokens: int
    wall_s: float
    ttfts_s: list[float]
    cpu_s: float | None = None  # CPU time of every process of the path (the benchmark's, the server's)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def ttft_p50_ms(self) -> float:
        return 1000 * statistics.median(self.ttfts_s)

    @property
    def cpu_ms_per_token(self) -> float | None:
        return None if self.cpu_s is None else 1000 * self.cpu_s / self.tokens


def with_cpu(run, pids: tuple[int, ...]) -> Result:
    """asyncio.run(run), its Result with the CPU time the processes `pids` spent meanwhile (where
    /proc is)."""
    if not Path("/proc/self/stat").exists():
        return asyncio.run(run)
    before = cpu_seconds(pids)
    result = asyncio.run(run)
    result.cpu_s = cpu_seconds(pids) - before
    return result


def prompts(count: int) -> list[str]:
    return [f"Request {i}: tell me something about the number {i * 7919 % 1000}." for i in range(count)]


async def measure(one_stream, count: int) -> Result:
    """Runs `count` streams at once; one_stream(i) -> (ttft_s, tokens)."""
    started = time.perf_counter()
    results = await asyncio.gather(*(one_stream(i) for i in range(count)))
    wall = time.perf_counter() - started
    return Result(count, sum(tokens for _, tokens in results), wall, [ttft for ttft, _ in results])


async def in_process(engine, count: int, max_tokens: int, tag: str) -> Result:
    """The servicer's own pattern (one Mailbox carries each step's outputs into the streams'
    asyncio.Queues, a stream that fell behind takes them coalesced), minus gRPC."""
    mailbox = Mailbox(asyncio.get_running_loop())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    texts = prompts(count)

    async def one_stream(i: int) -> tuple[float, int]:
        queue: asyncio.Queue = asyncio.Queue()
        sent = time.perf_counter()
        engine.add_request(f"{tag}-{i}", texts[i], params, mailbox.deliver_to(queue))
        ttft, tokens = None, 0
        while True:
            waiting = [await queue.get()]
            while not queue.empty():
                waiting.append(queue.get_nowait())
            for output in coalesce(waiting):
                if output.token_ids and ttft is None:
                    ttft = time.perf_counter() - sent
                tokens += len(output.token_ids)
                if output.finished:
                    return ttft, tokens

    return await measure(one_stream, count)


async def through_grpc(address: str, count: int, max_tokens: int) -> Result:
    params = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    texts = prompts(count)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        async def one_stream(i: int) -> tuple[float, int]:
            sent = time.perf_counter()
            ttft, tokens = None, 0
            async for message in stub.Generate(engine_pb2.GenerateRequest(text=texts[i], params=params)):
                if message.token_ids and ttft is None:
                    ttft = time.perf_counter() - sent
                tokens += len(message.token_ids)
            return ttft, tokens

        return await measure(one_stream, count)


def start_in_process(engine_flags: list[str]):
    from xserv_engine.engine.engine_thread import EngineThread
    from xserv_engine.engine.llm_engine import LLMEngine

    parser = argparse.ArgumentParser()
    engine_cli.add_engine_arguments(parser)
    engine = EngineThread(LLMEngine(engine_cli.engine_config_from_args(parser.parse_args(engine_flags))))
    engine.start()
    engine.warmup()
    return engine


def start_server(engine_flags: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "xserv_cli", "engine", "--port", str(port),
                               "--log-level", "warning", *engine_flags], cwd=REPO)
    address = f"127.0.0.1:{port}"
    wait_serving(address, server)
    return server, address


def compare(engine, server_pid: int, address: str, concurrency: list[int], max_tokens: int, repeat: int):
    """Alternates the two paths run by run (an idle engine waits without using the CPU), so that
    other load on a shared machine hits both alike. Returns every run per concurrency."""
    asyncio.run(in_process(engine, max(concurrency), max_tokens, "warm"))
    asyncio.run(through_grpc(address, max(concurrency), max_tokens))
    local, remote = {}, {}
    for n in concurrency:
        runs = [(with_cpu(in_process(engine, n, max_tokens, f"c{n}-r{r}"), (os.getpid(),)),
                 with_cpu(through_grpc(address, n, max_tokens), (os.getpid(), server_pid))) for r in range(repeat)]
        local[n] = [a for a, _ in runs]
        remote[n] = [b for _, b in runs]
    return local, remote


def median_run(results: list[Result]) -> Result:
    return sorted(results, key=lambda result: result.tok_per_s)[len(results) // 2]


def wait_serving(address: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == serving:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError("xserv engine did not become SERVING")


def table(local: dict[int, list[Result]], remote: dict[int, list[Result]]) -> str:
    lines = ["| streams | path | output tok/s (median) | tok/s range; each alternated pair's ratio | TTFT p50 (ms) "
             "| CPU ms per token (median) |", "|---:|---|---:|---:|---:|---:|"]
    for n in local:
        a, b = median_run(local[n]), median_run(remote[n])
        cpu_a, cpu_b = median_cpu(local[n]), median_cpu(remote[n])
        lines.append(f"| {n} | in-process | {a.tok_per_s:.1f} | {spread(local[n])} | {a.ttft_p50_ms:.1f} | {cpu_a} |")
        lines.append(f"| {n} | gRPC loopback | {b.tok_per_s:.1f} | {spread(remote[n])} | {b.ttft_p50_ms:.1f} | {cpu_b} |")
        pairs = [g.tok_per_s / l.tok_per_s for l, g in zip(local[n], remote[n])]
        cpu_ratio = "" if "-" in (cpu_a, cpu_b) else f"{float(cpu_b) / float(cpu_a):.3f}"
        lines.append(f"| {n} | gRPC / in-process | {b.tok_per_s / a.tok_per_s:.3f} | pairs: "
                     f"{', '.join(f'{r:.2f}' for r in pairs)} (median {statistics.median(pairs):.3f}) | "
                     f"{b.ttft_p50_ms / a.ttft_p50_ms:.3f} | {cpu_ratio} |")
    return "\n".join(lines)


def median_cpu(results: list[Result]) -> str:
    costs = [result.cpu_ms_per_token for result in results]
    return "-" if None in costs else f"{statistics.median(costs):.3f}"


def spread(results: list[Result]) -> str:
    rates = [result.tok_per_s for result in results]
    return f"{min(rates):.0f}-{max(rates):.0f}"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs per point; the median is shown")
    args, engine_flags = parser.parse_known_args()
    engine_flags = [flag for flag in engine_flags if flag != "--"] or DEFAULT_ENGINE_FLAGS
    wait_briefly()  # the in-process engine's OpenMP threads wait as `xserv engine`'s do
    engine = start_in_process(engine_flags)
    server, address = start_server(engine_flags)
    try:
        local, remote = compare(engine, server.pid, address, args.concurrency, args.max_tokens, args.repeat)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        engine.shutdown()
    print(f"\nmax_tokens={args.max_tokens}, median of {args.repeat} runs; engine flags: {' '.join(engine_flags)}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, python {platform.python_version()}\n")
    print(table(local, remote))


if __name__ == "__main__":
    main()

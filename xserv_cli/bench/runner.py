"""Drive a benchmark: requests arrive all at once or as a Poisson process, at most `concurrency`
in flight (a request that arrives while all are busy waits, unclocked, for a free worker),
one thread per stream; a progress bar on stderr."""

import queue
import random
import sys
import threading
import time

from tqdm import tqdm

from xserv_cli.bench.client import RequestResult, send_request
from xserv_cli.bench.config import BenchConfig
from xserv_cli.bench.report import Report, summarize


def arrival_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent (all 0 for an infinite rate)."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


def run_benchmark(config: BenchConfig, prompts: list[str], input_len: int | None = None,
                  progress: bool = True) -> Report:
    """Send every prompt once and summarize; input_len is only recorded in the report."""
    results: list[RequestResult | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="requests", unit="req", file=sys.stderr, disable=not progress, miniters=1)
    lock = threading.Lock()
    due: queue.Queue[int | None] = queue.Queue()
    failed = 0

    def worker() -> None:
        nonlocal failed
        while (index := due.get()) is not None:
            results[index] = send_request(config, prompts[index])
            with lock:
                failed += not results[index].ok
                bar.set_postfix(failed=failed, refresh=False)
                bar.update()

    # daemon threads: Ctrl-C ends the run without waiting for the streams in flight
    workers = [threading.Thread(target=worker, name=f"bench-{i}", daemon=True)
               for i in range(min(config.concurrency or len(prompts), len(prompts)))]
    start = time.perf_counter()
    with bar:
        for thread in workers:
            thread.start()
        for index, at in enumerate(arrival_times(len(prompts), config.request_rate, config.seed)):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            due.put(index)
        for _ in workers:
            due.put(None)
        for thread in workers:
            thread.join()
    return summarize(config, input_len, results, time.perf_counter() - start)

"""`xserv bench`: load-test an OpenAI-compatible endpoint and print (and optionally save) a report."""

DESCRIPTION = """\
Load-test an OpenAI-compatible endpoint (xserv, vLLM, SGLang, llama.cpp's server, ...): send
--num-requests streamed requests of random --input-len-token prompts, --concurrency at a time or
--request-rate per second, and report throughput and TTFT / TPOT / ITL / end-to-end latency
percentiles, with failures counted by kind. Token counts are the server's own (usage).

On --endpoint chat the server's chat template wraps each prompt in role markers, so the prompt
tokens reported are --input-len plus the template's (64 -> 72 on Qwen3's); the report shows both
shares. --endpoint completions sends the prompt as it is."""

import argparse
import json
import sys
import urllib.request

from xserv_cli.bench.client import send_request
from xserv_cli.bench.config import BenchConfig
from xserv_cli.bench.prompts import file_prompts, random_prompts
from xserv_cli.bench.report import format_report
from xserv_cli.bench.runner import run_benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the API root, up to /v1 (default: %(default)s)")
    target.add_argument("--model", default=None, help="model name to send (default: the first of GET /models)")
    target.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/chat/completions or /completions (default: %(default)s)")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take, stream included (default: %(default)s)")
    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=64, help="(default: %(default)s)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="most requests in flight at once (default: all of them)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second, Poisson arrivals (default: all at once)")
    load.add_argument("--input-len", type=int, default=128,
                      help="tokens of each random prompt; on --endpoint chat the chat template adds its own "
                           "(default: %(default)s)")
    load.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (default: %(default)s)")
    load.add_argument("--prompt-file", default=None, help="prompts, one per line, instead of random ones")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="send ignore_eos (vLLM's extra field) so every request makes --output-len tokens "
                           "(default: on)")
    load.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s, greedy)")
    load.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default: %(default)s)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def first_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(base_url.rstrip("/") + "/models", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.load(resp)["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or (args.concurrency is not None and args.concurrency < 1):
        print("xserv bench: --num-requests and --concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        model = args.model or first_model(args.base_url, args.api_key)
    except OSError as exc:
        print(f"xserv bench: cannot list models at {args.base_url}/models: {exc}", file=sys.stderr)
        return 1
    config = BenchConfig(base_url=args.base_url, model=model, endpoint=args.endpoint,
                         output_len=args.output_len, concurrency=args.concurrency,
                         request_rate=args.request_rate, ignore_eos=args.ignore_eos,
                         temperature=args.temperature, timeout_s=args.timeout, seed=args.seed,
                         api_key=args.api_key)
    # the unclocked first request checks the endpoint and warms the server up with a prompt of
    # its own: one of the timed prompts would be a prefix-cache hit when its turn came
    if args.prompt_file:
        prompts, input_len = file_prompts(args.prompt_file, args.num_requests, args.seed), None
        warm_up = random_prompts(1, 16, args.seed + 1)[0]
    else:
        *prompts, warm_up = random_prompts(args.num_requests + 1, args.input_len, args.seed)
        input_len = args.input_len
    check = send_request(config, warm_up)  # before the clock starts
    if not check.ok:
        print(f"xserv bench: the first request failed ({check.error_kind}): {check.error}", file=sys.stderr)
        return 1
    try:
        report = run_benchmark(config, prompts, input_len, progress=not args.no_progress)
    except KeyboardInterrupt:
        print("xserv bench: interrupted; no report", file=sys.stderr)
        return 130
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json() + "\n")
    return 0 if report.completed else 1

"""The bench client against a fake OpenAI SSE server: counts, percentiles, stream endings, errors."""

import json
import time

import pytest

from .fake_openai import Behaviour, FakeOpenAI
from xserv_cli import main as cli
from xserv_cli.bench import BenchConfig, format_report, random_prompts, run_benchmark
from xserv_cli.bench.runner import arrival_times


@pytest.fixture
def serve():
    servers = []

    def start(**behaviour) -> FakeOpenAI:
        servers.append(FakeOpenAI(Behaviour(**behaviour)))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def bench(server: FakeOpenAI, num_requests: int = 12, **options):
    config = BenchConfig(base_url=server.base_url, model="fake-model", **({"output_len": 5} | options))
    return run_benchmark(config, random_prompts(num_requests, input_len=16, seed=1), input_len=16, progress=False)


def assert_ordered(latency) -> None:
    assert 0 < latency.p50 <= latency.p90 <= latency.p99


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_counts_and_percentiles(serve, endpoint):
    server = serve()
    report = bench(server, endpoint=endpoint, concurrency=4)
    assert (report.completed, report.failed, report.errors) == (12, 0, {})
    assert report.output_tokens == 12 * 5 and report.prompt_tokens == 12 * 7
    for latency in (report.ttft_ms, report.itl_ms, report.e2e_ms, report.tpot_ms):
        assert_ordered(latency)
    assert report.ttft_ms.p99 <= report.e2e_ms.p99
    assert report.output_throughput == pytest.approx(60 / report.duration_s)
    sent = server.requests[0]
    assert sent["max_tokens"] == 5 and sent["ignore_eos"] is True and sent["stream_options"] == {"include_usage": True}
    assert ("messages" in sent) == (endpoint == "chat")
    assert len({json.dumps(r.get("prompt") or r["messages"]) for r in server.requests}) == 12


def test_concurrency_caps_streams_in_flight(serve):
    server = serve(delay_s=0.02)
    one_at_a_time = bench(server, num_requests=6, concurrency=1)
    all_at_once = bench(server, num_requests=6)
    assert one_at_a_time.completed == all_at_once.completed == 6
    assert one_at_a_time.duration_s > 2.5 * all_at_once.duration_s


def test_stream_without_done_ends_at_usage(serve):
    server = serve(send_done=False, hold_open=True)
    started = time.monotonic()
    report = bench(server, concurrency=12)
    assert time.monotonic() - started < 10  # the server holds each connection open for 30 s
    assert (report.completed, report.failed, report.output_tokens) == (12, 0, 60)


def test_without_usage_counts_text_chunks(serve):
    report = bench(serve(send_done=False, send_usage=False), concurrency=3, output_len=4)
    assert (report.completed, report.output_tokens, report.prompt_tokens) == (12, 48, 0)


@pytest.mark.parametrize("fail_with, kind", [("http", "HTTP 500"), ("event", "stream error event")])
def test_failures_are_counted_by_kind(serve, fail_with, kind):
    report = bench(serve(fail_every=3, fail_with=fail_with), concurrency=4)
    assert (report.completed, report.failed) == (8, 4)
    assert report.errors == {kind: 4}
    assert report.output_tokens == 8 * 5
    assert f"    4  {kind}" in format_report(report)


def test_unreachable_server_is_a_connection_error(serve):
    server = serve()
    server.stop()
    report = bench(server, num_requests=3)
    assert report.completed == 0 and list(report.errors) == ["connection: ConnectionRefusedError"]


def test_poisson_arrivals_are_seeded_with_the_requested_rate():
    times = arrival_times(4000, request_rate=20.0, seed=3)
    assert times == arrival_times(4000, request_rate=20.0, seed=3) != arrival_times(4000, 20.0, seed=4)
    assert times[-1] / len(times) == pytest.approx(1 / 20.0, rel=0.1)
    assert arrival_times(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_cli_prints_table_and_writes_json(serve, tmp_path, capsys):
    server = serve()
    out = tmp_path / "report.json"
    code = cli.main(["bench", "--base-url", server.base_url, "--num-requests", "8", "--concurrency", "2",
                     "--request-rate", "200", "--input-len", "8", "--output-len", "3", "--json", str(out),
                     "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out
    assert "model fake-model" in table and "completed / failed      8 / 0" in table
    saved = json.loads(out.read_text())
    assert saved["completed"] == 8 and saved["output_tokens"] == 24
    assert saved["config"]["request_rate"] == 200 and set(saved["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert len(server.requests) == 9  # the unclocked first request, then eight
    timed = {r["prompt"] if "prompt" in r else json.dumps(r["messages"]) for r in server.requests[1:]}
    first = server.requests[0]
    assert (first["prompt"] if "prompt" in first else json.dumps(first["messages"])) not in timed  # no cache hit


def test_cli_fails_when_the_first_request_fails(serve, capsys):
    server = serve(fail_every=1)
    assert cli.main(["bench", "--base-url", server.base_url, "--num-requests", "2", "--no-progress"]) == 1
    assert "HTTP 500" in capsys.readouterr().err


def test_prompt_file_lines_are_the_prompts(serve, tmp_path):
    server = serve()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\nthird prompt\n")
    assert cli.main(["bench", "--base-url", server.base_url, "--endpoint", "completions", "--num-requests", "5",
                     "--prompt-file", str(prompts), "--output-len", "2", "--no-progress"]) == 0
    sent = [r["prompt"] for r in server.requests[1:]]
    assert len(sent) == 5 and set(sent) == {"first prompt", "second prompt", "third prompt"}
    assert server.requests[0]["prompt"] not in sent  # the warm-up caches none of them


def test_help_says_what_bench_does_and_where_a_chat_prompts_extra_tokens_come_from(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "Load-test an OpenAI-compatible endpoint" in said
    assert "the prompt tokens reported are --input-len plus the template's (64 -> 72 on Qwen3's)" in said


@pytest.mark.parametrize("endpoint, says", [
    ("chat", "(10.0/request, from usage: 8 of the prompt + 2.0 of the chat template)"),
    ("completions", "(10.0/request, from usage)"),
])
def test_the_report_splits_a_chat_prompts_tokens_into_the_prompt_and_the_template(serve, capsys, endpoint, says):
    server = serve(prompt_tokens=10)
    assert cli.main(["bench", "--base-url", server.base_url, "--endpoint", endpoint, "--num-requests", "2",
                     "--input-len", "8", "--output-len", "2", "--no-progress"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("prompt tokens"))
    assert line.endswith(f"20 {says}")

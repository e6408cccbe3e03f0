"""`xserv bench` against a real `xserv up` on the demo model."""

import json
import subprocess
import sys

import pytest

from tests.support.processes import REPO, served

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def xserv_url():
    with served("up", "--workers", "1", "--threads", "16", "--num-kv-blocks", "256", "--max-model-len", "1024",
                "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        yield up.url + "/v1"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bench_against_xserv(xserv_url, endpoint, tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "xserv_cli", "bench", "--base-url", xserv_url, "--endpoint", endpoint,
         "--num-requests", "8", "--concurrency", "4", "--input-len", "32", "--output-len", "16",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "completed / failed      8 / 0" in done.stdout and "errors: none" in done.stdout
    report = json.loads(out.read_text())
    assert report["output_tokens"] == 8 * 16  # ignore_eos: every request runs to max_tokens
    prompt_per_request = report["prompt_tokens"] / 8
    assert prompt_per_request == 32 if endpoint == "completions" else 32 < prompt_per_request < 64
    assert 0 < report["ttft_ms"]["p50"] <= report["e2e_ms"]["p50"]
    assert report["output_throughput"] > 0

"""A speculating engine behind the SGLang Model Gateway: SMG's worker protocol gets the tokens the
engine's own Generate gives, while drafts are accepted underneath."""

import pytest
import requests
from openai import OpenAI
from xserv.v1 import engine_pb2

from tests.scaleout.gateway import CACHE_AWARE, Gateway
from tests.server.engine_process import started_engines
from tests.support.processes import free_port

pytestmark = pytest.mark.e2e

MODEL = "speculating-demo"
LOOPING = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def speculating(tmp_path_factory, demo_dir):
    logs = tmp_path_factory.mktemp("logs")
    metrics = free_port()
    with started_engines(1, "--model", str(demo_dir), "--served-model-name", MODEL, "--metrics-port", str(metrics),
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                         logs=logs) as engines:
        smg = Gateway([engines[0].address], *CACHE_AWARE, log_path=logs / "smg.log")
        try:
            smg.wait_ready(MODEL, workers=1)
            sdk = OpenAI(base_url=f"{smg.url}/v1", api_key="unused", max_retries=0, timeout=120)
            yield engines[0], sdk, f"http://127.0.0.1:{metrics}/metrics"
        finally:
            smg.stop()


def accepted(metrics_url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in requests.get(metrics_url, timeout=5).text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_total{"))


def test_greedy_completion_through_smg_equals_the_engines_own(speculating):
    engine, sdk, metrics_url = speculating
    before = accepted(metrics_url)
    answer = sdk.completions.create(model=MODEL, prompt=LOOPING, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 40
    assert accepted(metrics_url) > before  # SMG's call speculated
    direct = list(engine.stub.Generate(engine_pb2.GenerateRequest(
        text=LOOPING, params=engine_pb2.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)), timeout=120))
    assert answer.choices[0].text == "".join(r.text for r in direct)

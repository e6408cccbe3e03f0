"""A Qwen3-MoE engine behind the SGLang Model Gateway: SMG's worker protocol serves the MoE model as
it serves a dense one (the same greedy tokens as transformers' Qwen3MoeForCausalLM, through SMG)."""

import pytest
from openai import OpenAI
from xserv.v1 import engine_pb2

from tests.scaleout.gateway import CACHE_AWARE, Gateway
from tests.server.engine_process import started_engines
from tests.support.hf_reference import greedy_tokens
from tests.support.moe_checkpoint import SHAPES, write_moe_checkpoint

pytestmark = pytest.mark.e2e

MODEL = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def moe(tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("moe-smg")
    model = write_moe_checkpoint(path, demo_dir, next(iter(SHAPES)))
    logs = tmp_path_factory.mktemp("logs")
    with started_engines(1, "--model", str(path), "--served-model-name", MODEL, "--dtype", "float32",
                         logs=logs) as engines:
        smg = Gateway([engines[0].address], *CACHE_AWARE, log_path=logs / "smg.log")
        try:
            smg.wait_ready(MODEL, workers=1)
            yield engines[0], OpenAI(base_url=f"{smg.url}/v1", api_key="unused", max_retries=0, timeout=120), model
        finally:
            smg.stop()


def test_greedy_completion_through_smg_equals_the_engine_and_transformers(moe):
    engine, sdk, model = moe
    text = "The capital of France is"
    answer = sdk.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    direct = list(engine.stub.Generate(engine_pb2.GenerateRequest(
        text=text, params=engine_pb2.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)), timeout=120))
    assert answer.choices[0].text == "".join(r.text for r in direct)
    assert answer.usage.completion_tokens == 10
    prompt = list(engine.stub.Tokenize(engine_pb2.TokenizeRequest(text=text), timeout=30).token_ids)
    assert [t for r in direct for t in r.token_ids] == greedy_tokens(model, prompt, 10)

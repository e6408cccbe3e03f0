"""Qwen3-MoE end to end: `xserv up` (fp32) on random-weight MoE checkpoints of several shapes, its
greedy tokens against transformers' Qwen3MoeForCausalLM.generate, and the serving features that sit
above the model (structured outputs, forced tool calls, n > 1) on an MoE model."""

import random
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from tests.support.chat_features import assert_structured_output_forced_tool_call_and_n
from tests.support.hf_reference import greedy_tokens
from tests.support.moe_checkpoint import SHAPES, write_moe_checkpoint
from tests.support.processes import served
from xserv.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def up(request, tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("moe-up")
    model = write_moe_checkpoint(path, demo_dir, request.param)
    with served("up", "--model", str(path), "--workers", "1", "--threads", "8", "--num-kv-blocks", "64",
                "--max-model-len", "1024", "--dtype", "float32", "--log-level", "warning",
                stdout=subprocess.DEVNULL) as up:
        with grpc.insecure_channel(up.grpc_address) as channel:
            sdk = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            yield engine_pb2_grpc.EngineServiceStub(channel), sdk, model


def greedy_ids(stub, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = engine_pb2.GenerateRequest(request_id=request_id, token_ids=engine_pb2.TokenIds(ids=prompt),
                                         params=params)
    return [t for response in stub.Generate(request, timeout=120) for t in response.token_ids]


def test_greedy_tokens_of_several_prompts_at_once_equal_transformers(up):
    stub, _, model = up
    rng = random.Random(0)
    batch = [[rng.randrange(0, 151643) for _ in range(n)] for n in (7, 30, 1, 19)]
    with ThreadPoolExecutor(len(batch)) as pool:
        got = list(pool.map(lambda i: greedy_ids(stub, f"moe-e2e-{i}", batch[i], 16), range(len(batch))))
    for prompt, tokens in zip(batch, got):
        assert tokens == greedy_tokens(model, prompt, 16)


def test_structured_output_forced_tool_call_and_n_on_an_moe_model(up):
    assert_structured_output_forced_tool_call_and_n(up[1])

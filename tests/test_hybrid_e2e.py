"""Hybrid models end to end: `xserv up` (fp32) on random-weight Qwen3.5, Qwen3.5-MoE and Qwen3-Next
checkpoints, prompts prefilled in 12-token chunks and preempted under a 14-block cache, their greedy
tokens against transformers' generate; GetModelInfo's state pool; and the serving features above
the model (structured outputs, forced tool calls, n > 1) on a hybrid model."""

import random
import re
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from tests.support.chat_features import assert_structured_output_forced_tool_call_and_n
from tests.support.hf_reference import greedy_tokens
from tests.support.hybrid_checkpoint import SHAPES, write_hybrid_checkpoint
from tests.support.processes import free_port, served
from tests.test_moe_e2e import greedy_ids
from xserv.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def up(request, tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("hybrid-up")
    model = write_hybrid_checkpoint(path, demo_dir, request.param)
    metrics = free_port()
    # 14 blocks of 16 tokens: 6 prompts take 12, and as they grow by 40 tokens each, 25 (preemption)
    with served("up", "--model", str(path), "--workers", "1", "--threads", "8", "--num-kv-blocks", "14",
                "--block-size", "16", "--max-model-len", "224", "--max-num-batched-tokens", "12", "--dtype", "float32",
                "--metrics-port", str(metrics), "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        with grpc.insecure_channel(up.grpc_address) as channel:
            sdk = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            yield engine_pb2_grpc.EngineServiceStub(channel), sdk, model, f"http://127.0.0.1:{metrics}/metrics"


def test_greedy_tokens_in_chunks_and_under_preemption_equal_transformers(up):
    stub, _, model, metrics = up
    rng = random.Random(0)
    batch = [[rng.randrange(0, 151643) for _ in range(n)] for n in (7, 30, 1, 19, 40, 36)]
    with ThreadPoolExecutor(len(batch)) as pool:
        got = list(pool.map(lambda i: greedy_ids(stub, f"hybrid-e2e-{i}", batch[i], 40), range(len(batch))))
    for prompt, tokens in zip(batch, got):
        assert tokens == greedy_tokens(model, prompt, 40)
    text = urllib.request.urlopen(metrics, timeout=30).read().decode()
    assert float(re.search(r"^xserv_preemptions_total (\S+)$", text, re.MULTILINE).group(1)) > 0
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
    assert info.state_slots_total > 0 and info.state_slots_free == info.state_slots_total
    assert info.state_slot_bytes > 0 and info.kv_blocks_free == info.kv_blocks_total == 14


def test_structured_output_forced_tool_call_and_n_on_a_hybrid_model(up):
    assert_structured_output_forced_tool_call_and_n(up[1])

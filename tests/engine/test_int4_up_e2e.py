"""End to end: `xserv up --model DIR --dtype float32` serves an AWQ, a GPTQ and a compressed-tensors
W4A16 checkpoint with greedy answers token-identical to transformers on the same weights
dequantized (gRPC Generate, which carries the token ids), and GetModelInfo says int4."""

import grpc
import pytest
from xserv.v1 import engine_pb2, engine_pb2_grpc

from tests.engine.test_int4 import PROMPTS, hf_greedy
from tests.support.int4_checkpoint import write_int4_checkpoint
from tests.support.processes import served

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_xserv_up_serves_a_4bit_checkpoint_as_transformers_answers(tmp_path, hf_models, fmt):
    src, _ = hf_models(False)
    write_int4_checkpoint(src, tmp_path / "int4", tmp_path / "dequantized", fmt=fmt, act_order=fmt == "gptq")
    flags = ["--model", str(tmp_path / "int4"), "--dtype", "float32", "--num-kv-blocks", "64",
             "--max-model-len", "256", "--log-level", "warning"]
    with served("up", *flags) as up, grpc.insecure_channel(up.grpc_address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        assert stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30).quantization == "int4"
        for prompt in PROMPTS[:2]:
            request = engine_pb2.GenerateRequest(
                request_id=f"int4-{fmt}-{len(prompt)}", token_ids=engine_pb2.TokenIds(ids=prompt),
                params=engine_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            got = [t for message in stub.Generate(request, timeout=120) for t in message.token_ids]
            assert got == hf_greedy(tmp_path / "dequantized", prompt)

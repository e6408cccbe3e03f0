"""End to end: `xserv engine --speculative-config '{"method": "mtp", ...}'` as a process on a
random Qwen3.5 checkpoint with a multi-token-prediction layer: greedy tokens over gRPC equal
transformers' generate, GetModelInfo says mtp, and a checkpoint without the layer stops the
start with a line naming the field."""

import json

import pytest
from xserv.v1 import engine_pb2

from tests.engine.test_fidelity import hf_greedy
from tests.support.hybrid_checkpoint import add_mtp_layer, write_hybrid_checkpoint

from .engine_process import EngineProcess, start_engine

pytestmark = pytest.mark.e2e
MTP = '{"method": "mtp", "num_speculative_tokens": 2, "disable_when_slower": false}'


def test_greedy_tokens_over_grpc_with_mtp_equal_transformers(tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("qwen3_5-mtp")
    model = write_hybrid_checkpoint(path, demo_dir, "qwen3_5,v4-over-k2,tied")
    add_mtp_layer(path, model)
    engine = start_engine(tmp_path_factory, "--model", str(path), "--dtype", "float32", "--speculative-config", MTP)
    try:
        config = json.loads(engine.model_info().speculative_config)
        assert (config["method"], config["num_speculative_tokens"]) == ("mtp", 2)
        prompt = [(7919 * i) % 151643 for i in range(1, 41)]
        request = engine_pb2.GenerateRequest(
            request_id="mtp-e2e", token_ids=engine_pb2.TokenIds(ids=prompt),
            params=engine_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        tokens = [t for out in engine.stub.Generate(request, timeout=120) for t in out.token_ids]
        assert tokens == hf_greedy(model, tuple(prompt), 24)
    finally:
        assert engine.stop() == 0


def test_a_checkpoint_without_mtp_weights_exits_1_naming_the_field(tmp_path, demo_dir):
    write_hybrid_checkpoint(tmp_path / "model", demo_dir, "qwen3_5,v4-over-k2,tied")
    engine = EngineProcess("--model", str(tmp_path / "model"), "--speculative-config", MTP,
                           log_path=tmp_path / "engine.log")
    try:
        assert engine.proc.wait(timeout=120) == 1
        assert "speculative_config.method" in engine.log_text() and "no mtp.* weights" in engine.log_text()
        assert "Traceback" not in engine.log_text()
    finally:
        engine.stop()

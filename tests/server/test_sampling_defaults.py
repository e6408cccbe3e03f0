"""A model's recommended sampling values (generation_config.json: Qwen3's temperature 0.6, top_p
0.95, top_k 20) are what a Generate call's unset fields take, as vLLM and SGLang serve them;
values the call sets win, and --sampling-defaults openai goes back to temperature 1, no top-k."""

import json

import pytest
from xserv.v1 import engine_pb2

from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine

from .harness import ServerThread

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
OPENAI = {"temperature": 1.0}


@pytest.fixture(scope="module")
def qwen3_style_dir(demo_dir, tmp_path_factory):
    """The demo checkpoint with Qwen3-8B's generation_config.json (the weights linked, not copied)."""
    path = tmp_path_factory.mktemp("qwen3-defaults")
    for file in demo_dir.iterdir():
        if file.name != "generation_config.json":
            (path / file.name).symlink_to(file)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         **QWEN3}))
    return path


def serve(model_dir, sampling_defaults: str) -> ServerThread:
    server = ServerThread()
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", max_model_len=256,
                          num_kv_blocks=32, sampling_defaults=sampling_defaults)
    server.load(EngineThread(LLMEngine(config, progress=False)))
    return server


def tokens(server: ServerThread, **params) -> list[int]:
    request = engine_pb2.GenerateRequest(text="Tell me about lighthouses.", params=engine_pb2.SamplingParams(
        max_tokens=12, ignore_eos=True, seed=7, **params))
    return [t for message in server.stub.Generate(request, timeout=60) for t in message.token_ids]


@pytest.mark.parametrize("mode, expected", [("model", QWEN3), ("openai", OPENAI)])
def test_unset_sampling_fields_follow_the_engines_defaults(qwen3_style_dir, mode, expected):
    server = serve(qwen3_style_dir, mode)
    try:
        unset = tokens(server)
        assert unset == tokens(server, **expected)  # the same seed, the values spelt out
        other = QWEN3 if mode == "openai" else OPENAI
        # random weights: 12 draws at temperature 1 over 151,936 tokens vs top-20 never agree
        assert unset != tokens(server, **other)
        if mode == "model":  # a field set to its "off" value stays off: top-p 0.95 alone keeps far more than 20
            assert tokens(server, top_k=0) != unset
    finally:
        server.close()

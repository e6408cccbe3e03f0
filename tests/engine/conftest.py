"""Engine test fixtures: random Qwen3 models built and saved by transformers (fp32), with the demo
tokenizer files beside them, loaded through the normal model-directory path."""

import threading

import pytest
import torch

from tests.support.hybrid_checkpoint import copy_tokenizer, tokenizer_files
from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.sampling_params import SamplingParams


def tiny_qwen3_config(tie: bool, eos_token_id: int = 151645):
    """transformers' Qwen3Config of the tests' random models: the real vocabulary, a tiny body."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
        max_position_embeddings=1024, rope_theta=1_000_000.0, initializer_range=0.5,
        eos_token_id=eos_token_id, bos_token_id=151643,
    )


def save_hf_model(path, demo_dir, tie: bool, seed: int = 0):
    """Save the tiny Qwen3 model into path (a copy from the tests' build cache when it holds one);
    returns it as transformers loads it from there (eval mode)."""
    from tests.support.build_cache import cached_model, checkpoint_inputs

    def write(out):
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(seed)
        Qwen3ForCausalLM(tiny_qwen3_config(tie)).eval().save_pretrained(out)
        copy_tokenizer(demo_dir, out)

    inputs = checkpoint_inputs(save_hf_model, *tokenizer_files(demo_dir), repr((tie, seed)))
    return cached_model(path, f"qwen3-{'tied' if tie else 'untied'}-seed{seed}", inputs, write, "Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory, demo_dir):
    """tie -> (directory, transformers model), each saved once per session, when first asked for."""
    saved = {}

    def get(tie: bool):
        if tie not in saved:
            path = tmp_path_factory.mktemp("tied" if tie else "untied")
            saved[tie] = path, save_hf_model(path, demo_dir, tie=tie)
        return saved[tie]

    return get


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def hf_model_dir(request, hf_models):
    return hf_models(request.param)


@pytest.fixture(scope="session")
def tied_model_dir(hf_models):
    return hf_models(True)[0]


def make_engine(model_dir, **overrides) -> EngineThread:
    """A started fp32 CPU engine with 512 blocks of 16 tokens (the default, 1 GB of cache, costs
    allocating it and a block object per 16 tokens at every start)."""
    defaults = {"dtype": "float32", "device": "cpu", "block_size": 16, "num_kv_blocks": 512}
    config = EngineConfig(model=str(model_dir), **{**defaults, **overrides})
    engine = EngineThread(LLMEngine(config, progress=False))
    engine.start()
    return engine


class Collector:
    """Gathers a request's outputs; `wait()` returns them once every choice has finished."""

    def __init__(self, n: int = 1):
        self.outputs = []
        self.n = n
        self._done = threading.Event()
        self._finished = 0

    def __call__(self, out):
        self.outputs.append(out)
        if out.finished:
            self._finished += 1
            if self._finished == self.n:
                self._done.set()

    def wait(self, timeout: float = 120):
        assert self._done.wait(timeout), "request did not finish in time"
        return self.outputs

    def choice(self, index: int = 0):
        return [o for o in self.outputs if o.index == index]

    def text(self, index: int = 0) -> str:
        return "".join(o.text for o in self.choice(index))

    def token_ids(self, index: int = 0) -> list[int]:
        return [t for o in self.choice(index) for t in o.token_ids]

    def final(self, index: int = 0):
        return self.choice(index)[-1]


def generate(engine, prompt, request_id=None, **params):
    collector = Collector(params.get("n", 1))
    generate.counter += 1
    engine.add_request(request_id or f"req-{generate.counter}", prompt, SamplingParams(**params), collector)
    collector.wait()
    return collector


generate.counter = 0


def wait_idle(engine, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.free_blocks == stats.total_blocks:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")

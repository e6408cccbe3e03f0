"""The Triton backend (CUDA without flash-attn), checked on the CPU with Triton's interpreter.

Under TRITON_INTERPRET=1 the decode kernel runs on CPU tensors: the same kernel source a GPU
compiles, slowly. Its answers must equal the torch backend's over the same paged cache, and an
engine driven through it must generate what the torch backend generates. The variable must be
set before triton is first imported (transformers imports it too), so the checks run in a
fresh interpreter, all in one (starting one takes seconds): `python -m tests.engine.test_triton_backend
MODEL_DIR` prints each check's outcome, "ok" or its traceback, as one JSON line.
"""

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

from tests.support.engine_starts import cheap_engine_starts
from xserv_engine.layers.attention import (Attention, AttentionMetadata, DecodeMetadata, TorchAttentionBackend,
                                           select_backend)

pytest.importorskip("triton")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def interpreted(tied_model_dir) -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.test_triton_backend", str(tied_model_dir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.e2e  # a fresh interpreter under TRITON_INTERPRET (interpreted)
def test_decode_kernel_equals_the_torch_path(interpreted):
    assert interpreted["kernel"] == "ok", interpreted["kernel"]


@pytest.mark.e2e  # a fresh interpreter under TRITON_INTERPRET (interpreted)
def test_an_empty_context_gives_zeros_not_nan(interpreted):
    assert interpreted["empty"] == "ok", interpreted["empty"]


@pytest.mark.e2e  # a fresh interpreter under TRITON_INTERPRET (interpreted)
def test_engine_through_the_triton_backend_answers_as_the_torch_backend(interpreted):
    assert interpreted["engine"] == "ok", interpreted["engine"]


def test_non_power_of_two_block_size_is_refused():
    from xserv_engine.layers.attention.triton_backend import TritonAttentionBackend

    with pytest.raises(ValueError, match="power-of-two block_size"):
        TritonAttentionBackend().kv_cache_shape(4, 48, 2, 16)


def test_cuda_without_flash_attn_gets_the_triton_backend(monkeypatch, caplog):
    cuda = torch.device("cuda")  # select_backend only decides; nothing touches a GPU here
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    assert select_backend("auto", cuda).name == "triton"
    assert select_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ImportError):
        select_backend("flash", cuda)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "xserv_engine.layers.attention.triton_decode", raising=False)
    assert select_backend("auto", cuda).name == "torch"
    assert "neither flash-attn nor Triton" in caplog.text


# ---- the checks, run in the interpreted subprocess ----

def _layer(backend, num_blocks, block_size, hq=4, hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = Attention(hq, hkv, d, backend)
    shape = backend.kv_cache_shape(num_blocks, block_size, hkv, d)
    layer.k_cache, layer.v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    layer.block_size = block_size
    return layer


def _decode(backend, layer, q, block_tables, context_lens):
    meta = AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64), num_prefill_tokens=0,
                             decode=DecodeMetadata(context_lens=context_lens, block_tables=block_tables))
    backend.prepare(meta, layer.block_size)
    return backend.decode(layer, q, meta.decode)


def check_kernel() -> None:
    from xserv_engine.layers.attention.triton_backend import TritonAttentionBackend

    block_size, num_blocks = 8, 24
    gen = torch.Generator().manual_seed(1)
    # shuffled, shared and padded block tables; contexts ending mid-block, on a block edge, of one token
    block_tables = torch.randperm(num_blocks, generator=gen)[:20].view(4, 5).to(torch.int32)
    block_tables[3] = block_tables[0]
    block_tables[1, 1:] = 0
    context_lens = torch.tensor([33, 1, 16, 40], dtype=torch.int32)
    q = torch.randn(4, 6, 16, generator=gen)[:, :4]  # strided rows, as the model's q/k split gives
    reference, kernel = TorchAttentionBackend(), TritonAttentionBackend()
    expected = _decode(reference, _layer(reference, num_blocks, block_size), q, block_tables, context_lens)
    got = _decode(kernel, _layer(kernel, num_blocks, block_size), q, block_tables, context_lens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def check_empty() -> None:
    from xserv_engine.layers.attention.triton_backend import TritonAttentionBackend

    kernel = TritonAttentionBackend()
    out = _decode(kernel, _layer(kernel, 4, 8), torch.randn(2, 4, 16), torch.zeros(2, 1, dtype=torch.int32),
                  torch.tensor([0, 3], dtype=torch.int32))
    assert torch.equal(out[0], torch.zeros(4, 16)) and out[1].isfinite().all()


def check_engine(model_dir: str) -> None:
    from tests.engine.conftest import Collector, generate, make_engine, wait_idle
    from xserv_engine.sampling_params import SamplingParams

    def workload(engine):
        prompts = [list(range(1000 + 300 * i, 1000 + 300 * i + n)) for i, n in enumerate([5, 40, 17])]
        first = [generate(engine, p, max_tokens=6, temperature=0.0, ignore_eos=True).token_ids() for p in prompts]
        collectors = [Collector() for _ in range(2 * len(prompts))]  # concurrent, prefix-cache hits
        for i, (p, c) in enumerate(zip(prompts * 2, collectors)):
            engine.add_request(f"mix-{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), c)
        second = [c.wait() and c.token_ids() for c in collectors]
        wait_idle(engine)
        return first, second, [c.final().usage.cached_prompt_tokens for c in collectors]

    results = {}
    for name in ("torch", "triton"):
        engine = make_engine(model_dir, attention_backend=name)
        try:
            assert engine.runner.backend.name == name
            results[name] = workload(engine)
        finally:
            engine.shutdown()
    assert results["triton"] == results["torch"], results
    assert max(results["triton"][2]) == 32  # the 40-token prompt read two cached blocks


def _outcome(check, *args) -> str:
    try:
        check(*args)
    except Exception:
        return traceback.format_exc()
    return "ok"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cheap_engine_starts(pytest.MonkeyPatch())  # as in the pytest process (tests/conftest.py)
    print(json.dumps({"kernel": _outcome(check_kernel), "empty": _outcome(check_empty),
                      "engine": _outcome(check_engine, sys.argv[1])}))

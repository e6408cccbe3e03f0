"""Decode steps padded to batch-size buckets over preallocated buffers (decode_buckets.py).

On CUDA each bucket is a captured graph; capturing needs a GPU, but the padding, the buffers
and the scratch block are the same code uncaptured, and run here on the CPU: generation must
not change by a token. On the CPU (the cpu-traced route) each batch size is a traced forward:
the same, token for token, as the model run op by op.
"""

import logging

import pytest
import torch

from tests.engine.conftest import Collector, make_engine, wait_idle
from tests.support.moe_checkpoint import write_moe_checkpoint
from xserv_engine.engine.decode_buckets import BucketedDecode, batch_buckets
from xserv_engine.engine.engine_setup import Route
from xserv_engine.layers import native, ops
from xserv_engine.layers.linear import native_bf16
from xserv_engine.sampling_params import SamplingParams

needs_native = pytest.mark.skipif(not native.load_torch_ops(), reason="the native CPU ops did not build here")


def test_buckets_cover_every_batch_up_to_the_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


def _workload(engine):
    """Five concurrent greedy streams of different prompt and output lengths: the batch shrinks
    5 -> 1 as they finish, through buckets 8, 4, 2 and 1."""
    collectors = []
    for i, (n, max_tokens) in enumerate([(5, 9), (40, 14), (17, 4), (70, 20), (3, 11)]):
        collectors.append(Collector())
        prompt = list(range(2000 + 100 * i, 2000 + 100 * i + n))
        engine.add_request(f"b-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           collectors[-1])
    tokens = [c.wait() and c.token_ids() for c in collectors]
    wait_idle(engine)  # every block back, the scratch block never handed out
    return tokens


def test_bucketed_decode_generates_what_the_plain_step_does(tied_model_dir, monkeypatch):
    plain = make_engine(tied_model_dir)
    try:
        expected = _workload(plain)
    finally:
        plain.shutdown()
    batches = []
    original = BucketedDecode.run
    monkeypatch.setattr(BucketedDecode, "run", lambda self, seqs: batches.append(len(seqs)) or original(self, seqs))
    engine = make_engine(tied_model_dir)
    try:
        engine.runner.use_bucketed_decode(max_num_seqs=8, max_model_len=engine.setup.max_model_len, capture=False)
        got = _workload(engine)
    finally:
        engine.shutdown()
    assert got == expected
    assert {5, 3, 1} <= set(batches)  # padded to 8 and 4, and unpadded


def _traced_engine(model_dir, **overrides):
    """int8 weights, native ops, up to 4 sequences."""
    return make_engine(model_dir, quantization="int8", max_num_seqs=4, **overrides)


@pytest.fixture(params=["dense", "moe"])
def traced_model(request, tied_model_dir, tmp_path, demo_dir):
    """(directory, engine overrides) of a model the cpu-traced route runs: the dense model with
    every linear in int8 (on any CPU); the MoE model in bf16 (its router stays in the model's
    dtype, a traceable linear where the CPU has native bf16)."""
    if request.param == "dense":
        return tied_model_dir, {}
    if not native_bf16():
        pytest.skip("no native bf16 linears on this CPU: an MoE router is oneDNN's, which is not traced")
    write_moe_checkpoint(tmp_path, demo_dir, "mlp-only-layer-1,normalized,untied,sharded")
    return tmp_path, {"dtype": "bfloat16"}


@needs_native
def test_traced_decode_generates_what_the_ops_one_by_one_do(traced_model, monkeypatch):
    path, overrides = traced_model
    engine = _traced_engine(path, **overrides)
    try:
        assert engine.engine.setup.route is Route.CPU_TRACED
        assert sorted(engine.engine.runner.decode_buckets.traces) == [1, 2, 3, 4]
        engine.engine.runner.decode_buckets = None  # the engine is idle: its next step reads this
        expected = _workload(engine)
    finally:
        engine.shutdown()
        ops.set_native(False)
    batches = []
    original = BucketedDecode.run
    monkeypatch.setattr(BucketedDecode, "run", lambda self, seqs: batches.append(len(seqs)) or original(self, seqs))
    engine = _traced_engine(path, **overrides)
    try:
        got = _workload(engine)
    finally:
        engine.shutdown()
        ops.set_native(False)
    assert got == expected
    assert {4, 3, 1} <= set(batches)  # the five streams: 5 running is above the traces, then 4..1 traced


@needs_native
def test_a_forward_that_cannot_be_traced_runs_op_by_op(tied_model_dir, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise torch.jit.TracerWarning("Converting a tensor to a Python boolean might cause the trace to be incorrect")

    monkeypatch.setattr(torch.jit, "trace_module", refuse)
    with caplog.at_level(logging.INFO, logger="xserv_engine"):
        engine = _traced_engine(tied_model_dir)
    try:
        assert engine.engine.setup.route is Route.CPU_NATIVE  # what GetModelInfo reports
        assert engine.engine.runner.decode_buckets is None
        said = [r.getMessage() for r in caplog.records]
        assert any("cannot be traced (Converting a tensor" in m for m in said)
        assert any(m.startswith("route: cpu-native instead") for m in said)
        assert len(_workload(engine)) == 5
    finally:
        engine.shutdown()
        ops.set_native(False)

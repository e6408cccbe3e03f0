"""method mtp: drafts from the checkpoint's multi-token-prediction layer (Qwen3.5 dense and MoE).

Random weights accept next to none of its drafts, so besides greedy output equal to
transformers' (with drafts rejected, prefix hits and preemptions), the layer itself is checked
against a reference written from its formula on the checkpoint's tensors, and the drafts the
engine proposes while serving against that reference over transformers' hidden states."""

import json
import math

import pytest
import torch

from tests.engine.conftest import generate, make_engine
from tests.engine.test_fidelity import hf_greedy
from tests.engine.test_hybrid_models import assert_idle_with_every_slot_free, prompts, staggered_batch
from tests.support.hybrid_checkpoint import SHAPES, add_mtp_layer, write_hybrid_checkpoint
from xserv_engine.engine.mtp_drafter import MtpDrafter
from xserv_engine.engine.sequence import Sequence
from xserv_engine.errors import InvalidRequest
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.server.convert import model_info_to_pb


@pytest.fixture(scope="module", params=list(SHAPES))
def with_mtp(request, tmp_path_factory, demo_dir):
    """(directory, transformers model, the mtp.* tensors) of one hybrid shape: Qwen3.5, Qwen3.5-MoE,
    Qwen3-Next (its layer dense, as its decoder layer at that index would be)."""
    path = tmp_path_factory.mktemp(request.param.split(",")[0] + "-mtp")
    model = write_hybrid_checkpoint(path, demo_dir, request.param)
    return path, model, add_mtp_layer(path, model)


def mtp(k: int, **fields) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k, "disable_when_slower": False, **fields})


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, dims: int) -> torch.Tensor:
    """rotate_half rotary on the first `dims` of each head [T, heads, D]."""
    angles = positions[:, None].double() / theta ** (torch.arange(0, dims, 2).double() / dims)
    cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None].float() for f in (torch.cos, torch.sin))
    part = x[..., :dims]
    half = torch.cat([-part[..., dims // 2:], part[..., : dims // 2]], -1)
    return torch.cat([part * cos + half * sin, x[..., dims:]], -1)


def reference_mtp(t: dict, model, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The layer over positions 0..T-1 of one sequence, from the formula: hidden [T, H] the target's
    (after its final norm), next_tokens [T] the token after each position -> [T, H] after mtp.norm."""
    c = model.config
    eps, T = c.rms_norm_eps, len(hidden)
    embed = model.get_input_embeddings().weight.detach()
    x = torch.cat([rms(embed[next_tokens], t["mtp.pre_fc_norm_embedding.weight"], eps),
                   rms(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ t["mtp.fc.weight"].T
    p = "mtp.layers.0."
    h = rms(x, t[p + "input_layernorm.weight"], eps)
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q_and_gate = (h @ t[p + "self_attn.q_proj.weight"].T).view(T, heads, 2, d)  # per head: query, then gate
    q, gate = q_and_gate[:, :, 0], q_and_gate[:, :, 1]
    k = (h @ t[p + "self_attn.k_proj.weight"].T).view(T, kv_heads, d)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).view(T, kv_heads, d)
    rope = c.rope_parameters
    dims, positions = int(d * rope["partial_rotary_factor"]), torch.arange(T)
    q = rotary(rms(q, t[p + "self_attn.q_norm.weight"], eps), positions, rope["rope_theta"], dims)
    k = rotary(rms(k, t[p + "self_attn.k_norm.weight"], eps), positions, rope["rope_theta"], dims)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v) * torch.sigmoid(gate)
    x = x + o.reshape(T, heads * d) @ t[p + "self_attn.o_proj.weight"].T
    h = rms(x, t[p + "post_attention_layernorm.weight"], eps)
    return rms(x + _reference_mlp(t, p + "mlp.", h, c), t["mtp.norm.weight"], eps)


def _reference_mlp(t: dict, p: str, h: torch.Tensor, c) -> torch.Tensor:
    def swiglu(prefix, x):
        gate, up = x @ t[prefix + "gate_proj.weight"].T, x @ t[prefix + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ t[prefix + "down_proj.weight"].T

    if p + "gate.weight" not in t:
        return swiglu(p, h)
    weights, ids = (h @ t[p + "gate.weight"].T).softmax(-1).topk(c.num_experts_per_tok, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.stack([sum(w * swiglu(f"{p}experts.{e}.", row[None])[0] for w, e in zip(ws, es.tolist()))
                       for row, ws, es in zip(h, weights, ids)])
    return out + torch.sigmoid(h @ t[p + "shared_expert_gate.weight"].T) * swiglu(p + "shared_expert.", h)


def target_hidden(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states (after the final norm: what its LM head reads) [T, H]."""
    with torch.no_grad():
        return model.model(torch.tensor([token_ids])).last_hidden_state[0]


def test_the_layer_equals_its_formula_over_a_chunk_and_a_draft_step(with_mtp):
    """model.draft over a 21-position chunk, then one decode step at the next position fed its own
    output (as drafting k > 1 does), against the reference of the whole 22 positions."""
    path, model, tensors = with_mtp
    engine = make_engine(path, speculative_config=mtp(2))
    try:
        runner = engine.engine.runner
        token_ids = prompts(3, lengths=(23,))[0]
        hidden = target_hidden(model, token_ids)
        seq = Sequence(token_ids, SamplingParams(), runner.block_size)
        engine.engine.block_manager.allocate(seq)
        try:
            with torch.inference_mode():
                chunk = _draft(runner, seq, token_ids, hidden[:21], 0, 21)
                step = _draft(runner, seq, token_ids, chunk[-1:], 21, 22)
        finally:
            engine.engine.block_manager.deallocate(seq)
        want = reference_mtp(tensors, model, torch.cat([hidden[:21], chunk[-1:]]), torch.tensor(token_ids[1:23]))
        torch.testing.assert_close(chunk, want[:21], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step, want[21:], rtol=1e-4, atol=1e-4)
    finally:
        engine.shutdown()


def _draft(runner, seq, token_ids, hidden, start: int, end: int) -> torch.Tensor:
    """The runner's model.draft over positions [start, end) of seq, as a chunk."""
    from xserv_engine.layers.attention import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=runner.tensor(runner.slots(seq, start, end), torch.int64),
                             num_prefill_tokens=end - start, prefill=runner.prefill_metadata([seq], [start], [end]))
    runner.backend.prepare(meta, runner.block_size)
    return runner.model.draft(torch.tensor(token_ids[start + 1 : end + 1]), torch.arange(start, end), hidden, meta)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_with_mtp_equal_transformers_and_plain_decoding(with_mtp, k):
    """A staggered batch, then a prompt that shares the first's first two blocks (a prefix hit)."""
    path, model, _ = with_mtp
    engine = make_engine(path, max_num_seqs=8, speculative_config=mtp(k))
    try:
        batch = prompts(1, lengths=(40, 9, 23, 1))
        staggered_batch(engine, model, batch, [14, 10, 12, 8])
        shared = batch[0][:35] + prompts(4, lengths=(6,))[0]
        out = generate(engine, shared, max_tokens=10, temperature=0.0, ignore_eos=True)
        assert out.token_ids() == hf_greedy(model, tuple(shared), 10)
        assert out.outputs[-1].usage.cached_prompt_tokens >= 32
        spec = engine.stats().spec
        assert spec.num_draft_tokens > 0
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_preempted_sequences_draft_again_and_answer_the_same(with_mtp):
    path, model, _ = with_mtp
    engine = make_engine(path, num_kv_blocks=8, max_model_len=128, speculative_config=mtp(3))
    try:
        staggered_batch(engine, model, prompts(2, lengths=(20, 24, 18, 22)), [30, 30, 30, 30])
        assert engine.stats().preemptions > 0
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_the_drafts_proposed_while_serving_are_the_layers_over_the_targets_hidden_states(with_mtp, monkeypatch):
    """Every first draft the engine proposes (after plain steps, verifications and back-offs) is
    the reference layer's greedy token at the position before the sequence's last token, over
    transformers' hidden states of the whole sequence: the rows kept for it are the right ones.
    A draft that stands is made to stand by giving the verification the target's own token."""
    path, model, tensors = with_mtp
    prompt = prompts(5, lengths=(30,))[0]
    full = prompt + hf_greedy(model, tuple(prompt), 40)
    proposed = []
    real_propose = MtpDrafter.propose

    def recording(self, seqs, rooms):
        drafts = real_propose(self, seqs, rooms)
        proposed.extend((list(seq.token_ids), d[0]) for seq, d in zip(seqs, drafts))
        if len(proposed) % 2:  # every other one stands: the target's next token
            drafts = [[full[len(seq)]] for seq in seqs]
        return drafts

    monkeypatch.setattr(MtpDrafter, "propose", recording)
    engine = make_engine(path, speculative_config=mtp(1))
    try:
        assert generate(engine, prompt, max_tokens=40, temperature=0.0, ignore_eos=True).token_ids() == full[30:]
        assert engine.stats().spec.num_accepted_tokens > 0
    finally:
        engine.shutdown()
    assert len(proposed) >= 10
    embed = model.get_input_embeddings().weight.detach()
    with torch.no_grad():
        want = reference_mtp(tensors, model, target_hidden(model, full[:-1]), torch.tensor(full[1:]))
        head = model.get_output_embeddings().weight.detach() if model.get_output_embeddings() is not None else embed
        argmax = (want @ head.T).argmax(-1).tolist()
    for token_ids, draft in proposed:
        assert draft == argmax[len(token_ids) - 2], len(token_ids)


def test_a_checkpoint_without_mtp_weights_is_refused_by_name(tmp_path, demo_dir):
    write_hybrid_checkpoint(tmp_path, demo_dir, "qwen3_5,v4-over-k2,tied")
    with pytest.raises(InvalidRequest, match="no mtp.\\* weights") as refused:
        make_engine(tmp_path, speculative_config=mtp(1))
    assert refused.value.field == "speculative_config.method"


def test_model_info_and_vllms_spec_decode_metrics_report_mtp(with_mtp):
    from prometheus_client import CollectorRegistry, generate_latest

    from xserv_engine.server.vllm_metrics import VllmMetrics

    path, model, _ = with_mtp
    engine = make_engine(path, speculative_config=mtp(2))
    try:
        generate(engine, prompts(6, lengths=(12,))[0], max_tokens=12, temperature=0.0, ignore_eos=True)
        info = model_info_to_pb(engine.model_info(), engine.stats())
        assert (json.loads(info.speculative_config)["method"], json.loads(info.speculative_config)[
            "num_speculative_tokens"]) == ("mtp", 2)
        registry = CollectorRegistry()
        VllmMetrics(registry, engine, "m", 128)
        text = generate_latest(registry).decode()
        spec = engine.stats().spec
        assert spec.num_drafts > 0
        assert f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(spec.num_drafts)}' in text
        assert f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} ' \
               f'{float(spec.num_draft_tokens)}' in text
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in text
    finally:
        engine.shutdown()

"""The Gated DeltaNet's operations (layers/gated_delta_rule.py, the native ones in layers/ops.py)
against transformers' torch functions, the reference of the hybrid models."""

import pytest
import torch

from tests.engine.test_ops import DTYPES, built, close  # noqa: F401 (built: a fixture)
from xserv_engine.layers import gated_delta_rule as rule
from xserv_engine.layers import ops

HK, HV, DK, DV, K = 2, 4, 16, 24, 4  # more value heads than key heads, as Qwen3.5-35B-A3B
C = 2 * HK * DK + HV * DV


def hf():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def gates(n: int, gen):
    """(g, beta) of n tokens: decays between exp(-2) and 1, betas in (0, 1)."""
    return -torch.rand(n, HV, generator=gen) * 2, torch.rand(n, HV, generator=gen)


@pytest.mark.parametrize("n, chunked_from", [(1, None), (50, None), (130, None), (70, 20)],
                         ids=["1-token", "50-tokens", "130-tokens-several-blocks", "70-tokens-after-20"])
def test_the_chunked_rule_equals_transformers_and_carries_its_state(n, chunked_from):
    gen = torch.Generator().manual_seed(n)
    q, k = torch.randn(n, HK, DK, generator=gen), torch.randn(n, HK, DK, generator=gen)
    v = torch.randn(n, HV, DV, generator=gen)
    g, beta = gates(n, gen)
    ref, ref_state = hf().torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    if chunked_from is None:
        out, state, _ = rule.chunk_gated_delta_rule(q, k, v, g, beta, None)
    else:  # a prompt in two chunks: the second starts from the first's state
        a = slice(0, chunked_from)
        b = slice(chunked_from, n)
        first, mid, _ = rule.chunk_gated_delta_rule(q[a], k[a], v[a], g[a], beta[a], None)
        second, state, _ = rule.chunk_gated_delta_rule(q[b], k[b], v[b], g[b], beta[b], mid)
        out = torch.cat([first, second])
    torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n, snapshots", [(130, (16, 64, 80, 128, 130)), (40, (1, 39)), (64, (64,))],
                         ids=["several-blocks-every-16-and-the-end", "first-and-last-but-one", "a-block-end"])
def test_the_states_a_chunk_leaves_at_its_snapshots_equal_transformers_at_those_lengths(n, snapshots):
    """The prefix cache restores these: each must be the state transformers reaches after exactly
    that many tokens, inside a block of CHUNK or at its end."""
    gen = torch.Generator().manual_seed(n)
    q, k = torch.randn(n, HK, DK, generator=gen), torch.randn(n, HK, DK, generator=gen)
    v = torch.randn(n, HV, DV, generator=gen)
    g, beta = gates(n, gen)
    start = torch.randn(HV, DK, DV, generator=gen)
    out, state, taken = rule.chunk_gated_delta_rule(q, k, v, g, beta, start, snapshots)
    assert len(taken) == len(snapshots)
    for at, got in zip(snapshots, taken):
        _, want = hf().torch_chunk_gated_delta_rule(q[None, :at], k[None, :at], v[None, :at], g[None, :at],
                                                    beta[None, :at], initial_state=start[None].clone(),
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(taken[-1] if snapshots[-1] == n else state, state)


def test_recurrent_steps_equal_transformers_recurrent_rule():
    gen = torch.Generator().manual_seed(3)
    b = 3
    state = torch.randn(b, HV, DK, DV, generator=gen)
    q, k = torch.randn(b, 1, HK, DK, generator=gen), torch.randn(b, 1, HK, DK, generator=gen)
    v = torch.randn(b, 1, HV, DV, generator=gen)
    g, beta = (x.view(b, 1, HV) for x in gates(b, gen))
    ref, ref_state = hf().torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, new_state = rule.recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    torch.testing.assert_close(out, ref[:, 0])
    torch.testing.assert_close(new_state, ref_state)


def test_the_conv_over_chunks_and_steps_equals_transformers_over_the_whole():
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(20, C, generator=gen), torch.randn(C, K, generator=gen)
    ref = hf().causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    state = torch.zeros(C, K - 1)
    first, state = rule.causal_conv1d(x[:12], state, weight)
    second, state = rule.causal_conv1d(x[12:18], state, weight)
    steps = []
    for t in (18, 19):
        out, new = rule.causal_conv1d_step(x[t : t + 1], state[None], weight)
        steps.append(out)
        state = new[0]
    torch.testing.assert_close(torch.cat([first, second, *steps]), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_decode_step_equals_its_torch_path(built, dtype):
    gen = torch.Generator().manual_seed(5)
    slots = torch.tensor([3, 0, 5])
    mixed = torch.randn(3, C, generator=gen).to(dtype)
    g, beta = gates(3, gen)
    weight = torch.randn(C, K, generator=gen).to(dtype)
    conv = torch.randn(6, C, K - 1, generator=gen).to(dtype)
    ssm = torch.randn(6, HV, DK, DV, generator=gen)
    states = [(conv.clone(), ssm.clone()) for _ in range(2)]

    def step():
        cs, ss = states.pop(0)
        return ops.gated_delta_decode(mixed, g, beta.to(dtype), cs, weight, ss, slots, HK), cs, ss

    from tests.engine.test_ops import both

    native, torch_path = both(step)
    for mine, ref in zip(native, torch_path):
        close(mine, ref, dtype)
    untouched = [1, 2, 4]
    torch.testing.assert_close(native[2][untouched], ssm[untouched])  # other slots' states stay


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_gated_norm_equals_its_torch_path_and_transformers(built, dtype):
    gen = torch.Generator().manual_seed(6)
    o, z = torch.randn(7, DV, generator=gen).to(dtype), torch.randn(7, DV, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(DV, generator=gen)).to(dtype)
    from tests.engine.test_ops import both

    native, torch_path = both(ops.gated_rms_norm, o, z, weight, 1e-6)
    close(native, torch_path, dtype)
    norm = hf().Qwen3_5RMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        torch.testing.assert_close(torch_path, norm(o, z))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 37])  # shorter than the state, and longer
def test_native_prompt_conv_equals_its_torch_path(built, dtype, n):
    gen = torch.Generator().manual_seed(7 + n)
    x = torch.randn(n, C, generator=gen).to(dtype)
    weight = torch.randn(C, K, generator=gen).to(dtype)
    conv = torch.randn(3, C, K - 1, generator=gen).to(dtype)
    states = [conv.clone(), conv.clone()]
    from tests.engine.test_ops import both

    def chunk():
        state = states.pop(0)
        return ops.gated_delta_conv(x, state, weight, 1), state

    (native, native_state), (torch_out, torch_state) = both(chunk)
    close(native, torch_out, dtype)
    assert torch.equal(native_state, torch_state)  # the state is the inputs themselves
    assert torch.equal(native_state[0], conv[0]) and torch.equal(native_state[2], conv[2])


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kept", [2, 5], ids=["a-draft-falls", "all-stand"])
def test_a_verifications_rows_and_kept_states_are_plain_decodings_bit_for_bit(built, native, kept):
    """Speculation on a hybrid is exact only if a verification's rows and the states it keeps are
    the ones plain decoding computes: in bf16 a last-bit difference flips argmaxes (issue 50)."""
    from torch import nn

    from xserv_engine.layers.attention import StateMetadata
    from xserv_engine.layers.gated_delta_net import GatedDeltaNet, LinearAttentionShape

    torch.manual_seed(0)
    shape = LinearAttentionShape(4, 16, 16, 16, K)  # 16 value heads, as Qwen3.5-0.8B: softplus rounds by row count
    layer = GatedDeltaNet(shape, 64, 1e-6, lambda i, o: nn.Linear(i, o, bias=False)).to(torch.bfloat16)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    conv, ssm = torch.randn(3, shape.conv_dim, K - 1).to(torch.bfloat16), torch.randn(3, 16, 16, 16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    try:
        ops.set_native(native)
        with torch.inference_mode():
            layer.conv_state, layer.ssm_state = conv.clone(), ssm.clone()
            verified = layer(x, StateMetadata([], [], [], None, verify_groups=[(0, 5, 1)]))
            layer.keep_verified([(0, 5, 1)], [kept])
            after = layer.conv_state.clone(), layer.ssm_state.clone()
            layer.conv_state, layer.ssm_state = conv.clone(), ssm.clone()
            plain = torch.cat([layer(x[i : i + 1], StateMetadata([], [], [], torch.tensor([1]))) for i in range(kept)])
    finally:
        ops.set_native(False)
    assert torch.equal(verified[:kept], plain)
    assert torch.equal(after[0], layer.conv_state) and torch.equal(after[1], layer.ssm_state)

"""How a hybrid checkpoint's tensors (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) become the tensors of
models/qwen3.py, before the loader packs them as it packs Qwen3's.

- Text weights of a vision-language checkpoint (Qwen3.5, Qwen3-VL) sit under
  `model.language_model.`; the vision tower (`model.visual.`) loads as models/qwen3_vision.py holds
  it, or is skipped unread with --language-model-only; the multi-token-prediction layer (`mtp.`) is
  skipped unread unless speculative decoding drafts with it (models/mtp.py).
- Zero-centred RMSNorms (x * (1 + w)) are stored as 1 + w, Qwen3's form. The Gated DeltaNet's
  output norm is a plain one.
- The gated attention's q_proj holds, per head, the query then its gate: split into the q shard
  and the gate shard (q_gate) of the fused qkv_proj.
- Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped per key head, are reordered into Qwen3.5's
  in_proj_qkv, in_proj_z, in_proj_b and in_proj_a.
- The conv's weight [C, 1, K] is held as [C, K]; stacked experts (transformers 5's
  experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) load as they are.
"""

import torch

from xserv_engine.models.qwen3 import Qwen3Config
from xserv_engine.models.qwen3_vision import vision_views

SKIPPED_PARTS = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction layer"}
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
_ZERO_CENTRED_WHOLE = ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                       "mtp.pre_fc_norm_hidden.weight")
_STACKED = {".experts.gate_up_proj": ".experts.w13_weight", ".experts.down_proj": ".experts.w2_weight"}
_RENAMES = {".linear_attn.conv1d.weight": ".linear_attn.conv1d_weight",
            ".linear_attn.norm.weight": ".linear_attn.norm_weight",
            ".experts.gate_up_proj": ".experts.w13_weight", ".experts.down_proj": ".experts.w2_weight"}


def skipped_part(name: str, with_mtp: bool = False, with_vision: bool = False) -> str | None:
    """What the tensor belongs to if the text model does not use it (said once by the loader);
    with_mtp: the multi-token-prediction layer is used; with_vision: the vision tower is."""
    used = {"mtp.": with_mtp, "model.visual.": with_vision}
    return next((what for prefix, what in SKIPPED_PARTS.items()
                 if name.startswith(prefix) and not used[prefix]), None)


def checkpoint_views(cfg: Qwen3Config, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs the loader packs for one checkpoint tensor of a hybrid or a
    vision-language model."""
    if name.startswith("model.visual."):
        return [vision_views(name, tensor)]
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    if not cfg.is_hybrid:
        return [_stacked_experts(cfg, name, tensor) if name.endswith(tuple(_STACKED)) else (name, tensor)]
    for old, new in _RENAMES.items():
        if name.endswith(old):
            name = name.removesuffix(old) + new
    if name.endswith(".linear_attn.conv1d_weight"):
        return [(name, tensor.reshape(tensor.shape[0], -1))]
    if name.endswith(_ZERO_CENTRED) or name in _ZERO_CENTRED_WHOLE:
        return [(name, tensor.float() + 1.0)]
    if name.endswith(".self_attn.q_proj.weight") and cfg.attn_output_gate:
        per_head = tensor.view(cfg.num_attention_heads, 2, cfg.head_dim, -1)
        base = name.removesuffix("q_proj.weight")
        return [(base + "q_proj.weight", per_head[:, 0].reshape(-1, tensor.shape[-1])),
                (base + "q_gate.weight", per_head[:, 1].reshape(-1, tensor.shape[-1]))]
    if name.endswith(".in_proj_qkvz.weight"):
        return _qwen3_next_qkvz(cfg, name.removesuffix("in_proj_qkvz.weight"), tensor)
    if name.endswith(".in_proj_ba.weight"):
        s = cfg.linear
        ba = tensor.view(s.num_key_heads, 2, s.num_value_heads // s.num_key_heads, -1)
        base = name.removesuffix("in_proj_ba.weight")
        return [(base + "in_proj_b.weight", ba[:, 0].reshape(s.num_value_heads, -1)),
                (base + "in_proj_a.weight", ba[:, 1].reshape(s.num_value_heads, -1))]
    return [(name, tensor)]


def _stacked_experts(cfg: Qwen3Config, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """transformers 5's stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the
    model's w13 / w2; Qwen3-VL-MoE's released checkpoints hold them transposed ([E, H, 2I],
    [E, I, H]: transformers turns them at load), told apart by their shape."""
    suffix = next(s for s in _STACKED if name.endswith(s))
    rows = 2 * cfg.moe_intermediate_size if suffix == ".experts.gate_up_proj" else cfg.hidden_size
    if tensor.shape[1] != rows:
        tensor = tensor.transpose(1, 2)
    return name.removesuffix(suffix) + _STACKED[suffix], tensor


def _qwen3_next_qkvz(cfg: Qwen3Config, base: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Per key head: its q, its k, then the v and z of its value heads -> q, k, v and z whole."""
    s = cfg.linear
    group = s.num_value_heads // s.num_key_heads
    per_key = tensor.view(s.num_key_heads, 2 * s.key_head_dim + 2 * group * s.value_head_dim, -1)
    q, k, v, z = per_key.split([s.key_head_dim, s.key_head_dim, group * s.value_head_dim,
                                group * s.value_head_dim], dim=1)
    width = tensor.shape[-1]
    qkv = torch.cat([q.reshape(-1, width), k.reshape(-1, width), v.reshape(-1, width)])
    return [(base + "in_proj_qkv.weight", qkv), (base + "in_proj_z.weight", z.reshape(-1, width))]

"""Qwen3ForCausalLM in plain torch, dense and mixture-of-experts (Qwen3MoeForCausalLM: a router
and experts block where the dense MLP would be, everything else shared), and the hybrid
generation (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): per `layer_types`, a Gated DeltaNet
(layers/gated_delta_net.py) or a gated full attention (a sigmoid gate per head on its output,
rotary on part of each head) where the attention would be, and beside the routed experts a shared
expert with a sigmoid gate. Knows nothing about serving: tokens in, hidden states out.

The hybrid models' RMSNorms are zero-centred (x * (1 + w)); the loader stores 1 + w, so every
norm here is Qwen3's.

q/k/v and gate/up projections are stored fused (qkv_proj, gate_up_proj): one matmul each; an MoE
layer's experts are stacked (w13_weight, w2_weight). The loader packs the checkpoint's separate
tensors into them. Its weights are created uninitialized (layers/linear.py): the
loader fills every one and refuses a checkpoint that lacks any, so a random init would be work
thrown away at every start.
"""

from dataclasses import dataclass

import torch
from torch import nn

from xserv_engine.layers import ops
from xserv_engine.layers.activation import SiluAndMul
from xserv_engine.layers.attention import Attention, AttentionBackend, AttentionMetadata
from xserv_engine.layers.fused_moe import FusedExperts, route
from xserv_engine.layers.gated_delta_net import GatedDeltaNet, LinearAttentionShape
from xserv_engine.layers.layernorm import RMSNorm, rms_norm
from xserv_engine.layers.linear import uninitialized_embedding, uninitialized_linear
from xserv_engine.layers.rotary_embedding import RotaryEmbedding
from xserv_engine.models.qwen3_vision import ImageEmbeddings, Qwen3VisionModel, VisionConfig
from xserv_engine.models.mtp import MultiTokenPredictor


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # mixture of experts (Qwen3-MoE); num_experts 0: every layer is a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # hybrid models: "linear_attention" or "full_attention" per layer; () = all full attention
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionShape | None = None
    attn_output_gate: bool = False  # q_proj also yields a gate per head (sigmoid, on the output)
    partial_rotary_factor: float = 1.0  # rotary on this share of each head's dims
    zero_centered_norms: bool = False  # checkpoint norms hold w of x * (1 + w)
    mtp_num_hidden_layers: int = 0  # the checkpoint's multi-token-prediction layers (models/mtp.py)
    # chat images are admitted (a vision-language checkpoint with its vision tower loaded)
    accepts_images: bool = False
    # vision-language checkpoints (Qwen3-VL, Qwen3.5): the vision tower's shape (None: a text
    # model, or one served with --language-model-only), the placeholder token each image's tokens
    # replace, and MRoPE's interleaved sections (layers/rotary_embedding.py)
    vision: VisionConfig | None = None
    image_token_id: int = -1
    mrope_section: tuple[int, ...] = ()

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def is_linear_layer(self, layer: int) -> bool:
        # the multi-token-prediction layer, past the last one, is full attention
        return layer < len(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: experts unless mlp_only_layers names it, every decoder_sparse_step-th."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf(cls, top: dict, language_model_only: bool = False) -> "Qwen3Config":
        # a vision-language checkpoint (Qwen3_5ForConditionalGeneration) nests the text model's
        cfg = {**top.get("text_config", {}), **{k: v for k, v in top.items() if k == "tie_word_embeddings"}} \
            if "text_config" in top else top
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta", 1_000_000)
        fields = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,  # 0: every layer has experts (Qwen3.5-MoE)
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # transformers 5 writes num_experts as num_local_experts
            num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            # Qwen3-VL-MoE's router always renormalizes its top-k
            norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg.get("model_type") == "qwen3_vl_moe_text")),
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
        return cls(**{**fields, **_hybrid_fields(cfg, rope), **_vision_fields(top, rope, language_model_only)})


# MRoPE's sections where rope_parameters leaves them out (transformers' defaults)
_MROPE_SECTIONS = {"qwen3_vl": (24, 20, 20), "qwen3_vl_moe": (24, 20, 20), "qwen3_5": (11, 11, 10),
                   "qwen3_5_moe": (11, 11, 10)}


def _vision_fields(top: dict, rope: dict, language_model_only: bool) -> dict:
    """Qwen3Config's vision fields of a vision-language checkpoint's config; {} for a text one
    or with language_model_only (its tower is then neither loaded nor run)."""
    if "vision_config" not in top or language_model_only:
        return {}
    section = rope.get("mrope_section") or _MROPE_SECTIONS.get(top.get("model_type", ""), (24, 20, 20))
    return dict(vision=VisionConfig.from_hf(top["vision_config"]), image_token_id=top["image_token_id"],
                mrope_section=tuple(section), accepts_images=True)


def _hybrid_fields(cfg: dict, rope: dict) -> dict:
    """Qwen3Config's hybrid fields of a qwen3_5 / qwen3_5_moe / qwen3_next config (transformers'
    defaults where a field is left out); {} for the Qwen3 generation."""
    model_type = str(cfg.get("model_type", ""))
    if not model_type.startswith(("qwen3_5", "qwen3_next")):
        return {}
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    layer_types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    return dict(
        layer_types=tuple(layer_types),
        linear=LinearAttentionShape(
            num_key_heads=cfg.get("linear_num_key_heads", 16), num_value_heads=cfg.get("linear_num_value_heads", 32),
            key_head_dim=cfg.get("linear_key_head_dim", 128), value_head_dim=cfg.get("linear_value_head_dim", 128),
            conv_kernel=cfg.get("linear_conv_kernel_dim", 4)),
        attn_output_gate=bool(cfg.get("attn_output_gate", True)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        zero_centered_norms=True,
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if cfg.get("num_experts") else 0,
        # Qwen3.5-MoE's router always renormalizes its top-k
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        # Qwen3-Next spells it num_nextn_predict_layers
        mtp_num_hidden_layers=cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)) or 0,
    )


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.gated, self.rotary_dim = cfg.attn_output_gate, cfg.rotary_dim
        # rows: q, k, v, and with the output gate the gate's (the loader moves them to the end)
        self.qkv_proj = uninitialized_linear(cfg.hidden_size, (2 if self.gated else 1) * self.q_size + 2 * self.kv_size)
        self.o_proj = uninitialized_linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)
        self._qk_weight: torch.Tensor | None = None

    def forward(self, rope: ops.Rope, x: torch.Tensor, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        # q and k heads sit side by side in qkv: normalise and rotate them as one tensor
        # [T, Hq + Hkv, D] (each head with its own norm's weight): one op
        if self.rotary_dim == self.head_dim:
            qk = ops.qk_norm_rope(qkv, self._qk_norm_weight(), self.q_norm.eps, rope)
        else:
            qk = self._qk_norm_partial_rope(qkv, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size : self.q_size + 2 * self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, meta).reshape(-1, self.q_size)
        if self.gated:
            o = o * torch.sigmoid(qkv[:, self.q_size + 2 * self.kv_size :])
        return self.o_proj(o)

    def _qk_norm_partial_rope(self, qkv: torch.Tensor, rope: ops.Rope) -> torch.Tensor:
        """qk_norm_rope's torch form with rotary on each head's first rotary_dim dims (the hybrid
        models' partial_rotary_factor; their text-only MRoPE is plain rotary: all three position
        rows are equal)."""
        heads = self.num_heads + self.num_kv_heads
        qk = rms_norm(qkv[:, : heads * self.head_dim].view(-1, heads, self.head_dim), self._qk_norm_weight(),
                      self.q_norm.eps)
        rotated = rope.rotary.apply_one(qk[..., : self.rotary_dim], *rope.cos_sin())
        return torch.cat([rotated, qk[..., self.rotary_dim :]], dim=-1)


    def _qk_norm_weight(self) -> torch.Tensor:
        # [Hq + Hkv, D]: each head's norm weight; built once, after the weights were loaded
        if self._qk_weight is None:
            self._qk_weight = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                                         self.k_norm.weight.expand(self.num_kv_heads, -1)]).detach()
        return self._qk_weight


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = uninitialized_linear(cfg.hidden_size, 2 * intermediate_size)
        self.down_proj = uninitialized_linear(intermediate_size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """The router (gate) picks num_experts_per_tok experts per token; their outputs, weighted by
    the router, are summed; the hybrid models add a shared expert, its output scaled by a sigmoid
    gate per token."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = uninitialized_linear(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Qwen3MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = uninitialized_linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.normalize)  # [T, K] each
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.linear_attn = None  # one of them, named as in the checkpoint
        if cfg.is_linear_layer(index):
            self.linear_attn = GatedDeltaNet(cfg.linear, cfg.hidden_size, cfg.rms_norm_eps, uninitialized_linear)
        else:
            self.self_attn = Qwen3Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MoeSparseMoeBlock(cfg) if cfg.is_moe_layer(index) else Qwen3MLP(cfg)

    def forward(self, rope: ops.Rope, x: torch.Tensor, residual: torch.Tensor | None, meta):
        """x: the previous layer's output (its MLP's), residual: the stream before it (None for the
        first layer, whose x is the embedding) -> (this layer's MLP output, the stream before it).
        The residual adds ride with the next norm (ops.add_rms_norm): one op each."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm1.weight, norm1.eps)
        else:
            residual, h = ops.add_rms_norm(residual, x, norm1.weight, norm1.eps)
        mixed = self.self_attn(rope, h, meta) if self.linear_attn is None else self.linear_attn(h, meta.states)
        residual, h = ops.add_rms_norm(residual, mixed, norm2.weight, norm2.eps)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = uninitialized_embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.mrope_section)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta, images: ImageEmbeddings | None = None):
        """positions [T], or MRoPE's [3, T] where the step holds image tokens."""
        x = self.embed_tokens(input_ids)  # [T, H]
        if images is not None:
            x[images.mask] = images.embeddings.to(x.dtype)
        rope = ops.Rope(self.rotary, positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual, meta)
            if images is not None and i < len(images.deepstack):  # Qwen3-VL's DeepStack
                x[images.mask] += images.deepstack[i].to(x.dtype)
        return ops.add_rms_norm(residual, x, self.norm.weight, self.norm.eps)[1]


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        # the hybrid models' (models/hybrid_weights.py splits their q_proj and Qwen3-Next's fused forms)
        "q_gate": ("qkv_proj", "gate"),
        "in_proj_qkv": ("in_proj", "qkv"), "in_proj_z": ("in_proj", "z"), "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }

    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend, lm_head: bool = True, mtp: bool = False):
        """lm_head=False: an embedding model's body alone (its checkpoint has no head). mtp: with
        the checkpoint's multi-token-prediction layer (models/mtp.py), for speculative decoding."""
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, backend)
        self.visual = Qwen3VisionModel(cfg.vision) if cfg.vision is not None else None  # model.visual.*
        self.mtp = MultiTokenPredictor(cfg, backend, Qwen3DecoderLayer, uninitialized_linear) if mtp else None
        self.lm_head = uninitialized_linear(cfg.hidden_size, cfg.vocab_size) if lm_head else None
        if lm_head and cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                images: ImageEmbeddings | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, images)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]

    def draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
              meta: AttentionMetadata, step: int = 0) -> torch.Tensor:
        """The multi-token-prediction layer at positions [T] (MRoPE's [3, T] over image tokens, as
        the target's): hidden [T, H] (this forward's output there, or the layer's own at the
        previous draft step) and input_ids [T] (the token after each position) -> its hidden
        states [T, H], for compute_logits."""
        embeddings = self.model.embed_tokens(input_ids)
        return self.mtp(embeddings, hidden, ops.Rope(self.model.rotary, positions, embeddings.dtype), meta, step)

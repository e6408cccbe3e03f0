"""Qwen3ForCausalLM in plain torch. Knows nothing about serving: tokens in, hidden states out.

q/k/v and gate/up projections are stored fused (qkv_proj, gate_up_proj): one matmul each.
The loader packs the checkpoint's separate tensors into them.
"""

from dataclasses import dataclass

import torch
from torch import nn

from xserv_engine.layers.activation import SiluAndMul
from xserv_engine.layers.attention import Attention, AttentionBackend, AttentionMetadata
from xserv_engine.layers.layernorm import RMSNorm, rms_norm
from xserv_engine.layers.rotary_embedding import RotaryEmbedding


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

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3Config":
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1_000_000)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)
        self._qk_weight: torch.Tensor | None = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        # q and k heads sit side by side in qkv: normalise and rotate them as one tensor
        # [T, Hq + Hkv, D] (each head with its own norm's weight): half the small ops.
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = RotaryEmbedding.apply_one(rms_norm(qk, self._qk_norm_weight(), self.q_norm.eps), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(-1, self.q_size))


    def _qk_norm_weight(self) -> torch.Tensor:
        # [Hq + Hkv, D]: each head's norm weight; built once, after the weights were loaded
        if self._qk_weight is None:
            self._qk_weight = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                                         self.k_norm.weight.expand(self.num_kv_heads, -1)]).detach()
        return self._qk_weight


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, rope, x, meta):
        h = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(rope, x, meta)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Qwen3Config, backend: AttentionBackend, lm_head: bool = True):
        """lm_head=False: an embedding model's body alone (its checkpoint has no head)."""
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if lm_head else None
        if lm_head and cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]

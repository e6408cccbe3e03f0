"""The vision tower of Qwen3-VL and Qwen3.5 (transformers' Qwen3VLVisionModel, Qwen3_5VisionModel):
patches in, one embedding per merge window of patches out, at the text model's width.

- the Conv3d patch embedding has stride = kernel, so it is a linear over each flattened patch
  (the loader reshapes its [D, C, T, P, P] weight to [D, C*T*P*P]);
- a learned square position table, resampled bilinearly (align_corners) to each image's grid;
- 2-D rotary: a quarter of each head's dims turn with the patch's row, a quarter with its column,
  repeated (rotate_half over the whole head);
- attention within each image only (no mask across images: one call per image, layers/ops.py);
- the merger: LayerNorm, then the 2x2 window's four patches side by side, fc, GELU, fc;
- Qwen3-VL's DeepStack: after the blocks named by deepstack_visual_indexes, a merger of its own
  (LayerNorm after the shuffle) makes features the text model adds at the image's positions of
  its first layers. Qwen3.5 has none.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xserv_engine.layers import ops
from xserv_engine.layers.linear import uninitialized_embedding, uninitialized_linear
from xserv_engine.layers.rotary_embedding import RotaryEmbedding


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, cfg: dict) -> "VisionConfig":
        rope = cfg.get("rope_parameters") or {}
        names = ("in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size", "hidden_act")
        return cls(
            depth=cfg["depth"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_heads=cfg["num_heads"], out_hidden_size=cfg["out_hidden_size"],
            num_position_embeddings=cfg["num_position_embeddings"],
            deepstack_visual_indexes=tuple(cfg.get("deepstack_visual_indexes") or ()),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            **{name: cfg[name] for name in names if name in cfg})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class VisionOutput:
    embeddings: torch.Tensor  # [num_tokens, out_hidden] for all images, in order
    deepstack: tuple[torch.Tensor, ...]  # one [num_tokens, out_hidden] per DeepStack layer


@dataclass(frozen=True)
class ImageEmbeddings:
    """What a forward's image tokens take from the vision tower, in the order they come."""
    mask: torch.Tensor  # [T] bool: the forward's tokens that are image tokens
    embeddings: torch.Tensor  # [mask.sum(), H]: they replace those tokens' embeddings
    deepstack: tuple[torch.Tensor, ...] = ()  # [mask.sum(), H] each, added after text layer i


def _gelu(name: str):
    approximate = "tanh" if name == "gelu_pytorch_tanh" else "none"
    if name not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"vision hidden_act {name!r} is not supported (gelu, gelu_pytorch_tanh)")
    return lambda x: F.gelu(x, approximate=approximate)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = uninitialized_linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = uninitialized_linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, lengths: list[int]):
        n = x.shape[0]
        # [3, H, n, D] with each head's rows side by side: attention reads every head as one matrix
        # (the native op needs it; torch's flash kernel is 20% slower on qkv's strided views)
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3).contiguous().unbind(0)
        # rotated in fp32, as transformers does, then back to the model dtype
        q = RotaryEmbedding.apply_one(q.float(), cos, signed_sin).to(x.dtype)
        k = RotaryEmbedding.apply_one(k.float(), cos, signed_sin).to(x.dtype)
        out = [ops.vision_attention(qi, ki, vi)
               for qi, ki, vi in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))]  # [n, H, D] each
        return self.proj(torch.cat(out).view(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = uninitialized_linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = uninitialized_linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _gelu(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, signed_sin, lengths):
        x = x + self.attn(self.norm1(x), cos, signed_sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """A merge window's patches -> one token at the text width. postshuffle: the norm sees the
    window's patches side by side (DeepStack's mergers) instead of each patch (the final one)."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = uninitialized_linear(self.width, self.width, bias=True)
        self.linear_fc2 = uninitialized_linear(self.width, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionPatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = uninitialized_linear(cfg.patch_dim, cfg.hidden_size, bias=True)  # the Conv3d, over flattened patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class Qwen3VisionModel(nn.Module):
    """Named as the checkpoint's `model.visual.*`; forward(pixel_values, grid_thw) -> VisionOutput."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = VisionPatchEmbed(cfg)
        self.pos_embed = uninitialized_embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        half = cfg.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)),
                             persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionOutput:
        """pixel_values [num_patches, C*T*P*P] of the images of grid_thw, concatenated in order."""
        rows, cols = self._patch_coordinates(grid_thw)
        x = self.patch_embed(pixel_values)  # [N, D]
        x = x + self._interpolated_positions(rows, cols, grid_thw).to(x.dtype)
        cos, signed_sin = self._rotary(rows, cols)
        lengths = [t * h * w for t, h, w in grid_thw]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, signed_sin, lengths)
            if i in self.config.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)](x))
        return VisionOutput(self.merger(x), tuple(deepstack))

    def _patch_coordinates(self, grid_thw) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) in its image, in the processor's order: by merge window."""
        m = self.config.spatial_merge_size
        rows, cols = [], []
        for t, h, w in grid_thw:
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            window_order = lambda a: a.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)  # noqa: E731
            rows.append(window_order(r))
            cols.append(window_order(c))
        device = self.inv_freq.device
        return torch.cat(rows).to(device), torch.cat(cols).to(device)

    def _interpolated_positions(self, rows, cols, grid_thw) -> torch.Tensor:
        """The position table resampled bilinearly (align_corners) to each image's grid: [N, D]."""
        device = rows.device
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grid_thw]).to(device)
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grid_thw]).to(device)
        h_taps, h_weights = self._taps(rows, heights)
        w_taps, w_weights = self._taps(cols, widths)
        indices = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(indices) * weights[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)

    def _taps(self, index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the same fp32 expressions as transformers' get_vision_interpolation_indices_and_weights
        src = index.to(torch.float32) * (self.side - 1) / torch.clamp(size - 1, min=1)
        floor = torch.floor(src)
        offsets = torch.arange(0, 2, device=index.device)
        taps = (floor.long()[:, None] + offsets).clamp(0, self.side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights

    def _rotary(self, rows, cols) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, head_dim] cos and signed sin (RotaryEmbedding.apply_one's form, broadcast over heads), fp32."""
        freqs = torch.cat([rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = emb.shape[-1] // 2
        signed_sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
        return emb.cos(), signed_sin


def vision_views(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A checkpoint tensor under `model.visual.` -> the (name, tensor) Qwen3ForCausalLM.visual holds."""
    name = "visual." + name.removeprefix("model.visual.")
    if name == "visual.patch_embed.proj.weight":
        return name, tensor.reshape(tensor.shape[0], -1)
    return name, tensor

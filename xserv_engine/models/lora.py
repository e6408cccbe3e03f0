"""LoRA adapters (PEFT's format), served beside the base model, one per sequence.

An adapter adds scale * B @ A to some of the decoder's linears (W x becomes W x + scale B A x).
The model keeps its fused projections (qkv_proj, gate_up_proj), so an adapter's q/k/v (gate/up)
pairs are stacked into one A ([sum of ranks, in]) and one block-diagonal B ([out, sum of ranks],
zero where a projection is not adapted, the scale folded in): one pair of small matmuls per
fused linear, whatever the adapter targets. Nothing is merged into the base weights, so any mix
of adapters and the bare model shares one batch: each LoraLinear adds, for each adapter in the
step, its delta to that adapter's rows (LoraBatch, set by the model runner before a forward).

Hybrid models (Qwen3.5, Qwen3-Next): adapters of the full-attention layers' and the dense MLPs'
projections are served (a gated q_proj's B splits, per head, into the query's rows and the
gate's, as the loader splits the weight); of the Gated DeltaNet's (linear_attn.*), refused by name.
"""

import json
import logging
import math
import re
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from xserv_engine.errors import InvalidRequest
from xserv_engine.models.qwen3 import Qwen3Config

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's tensor names: base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# checkpoint projection -> (fused linear of the model, its slice)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_ids = count(1)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (its weights are tensors)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its projections'
    # (layer, fused linear) -> (A^T [in, R], (scale * B)^T [R, out]): x @ at @ bt is the delta
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    id: int = field(default_factory=lambda: next(_ids))  # never reused: keys its prefix-cache blocks

    @property
    def hash_root(self) -> int:
        """The prefix-cache chain of its sequences starts here: the same tokens through another
        adapter (or none) have other keys and values."""
        return hash(("lora", self.id))


def slice_sizes(cfg: Qwen3Config) -> dict[str, tuple[int, list[int]]]:
    """Fused linear -> (its input width, its slices' output widths), as Qwen3ForCausalLM builds them."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = [q, kv, kv, q] if cfg.attn_output_gate else [q, kv, kv]  # the gate's rows last
    return {"qkv_proj": (h, qkv), "o_proj": (q, [h]), "gate_up_proj": (h, [i, i]), "down_proj": (i, [h])}


def _parts(cfg: Qwen3Config, proj: str, part: int, a: torch.Tensor, b: torch.Tensor) -> list:
    """(slice, A, scaled B) of one adapted projection: a gated q_proj's B [2 Hq D, r] holds each
    head's query rows then its gate rows, which go to slices 0 and 3 (one A for both)."""
    if proj != "q_proj" or not cfg.attn_output_gate:
        return [(part, a, b)]
    per_head = b.view(cfg.num_attention_heads, 2, cfg.head_dim, -1)
    return [(0, a, per_head[:, 0].reshape(-1, b.shape[1])), (3, a, per_head[:, 1].reshape(-1, b.shape[1]))]


def load_lora_adapter(name: str, path: str | Path, cfg: Qwen3Config, dtype: torch.dtype, device: torch.device,
                      max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) for a model of
    `cfg`; InvalidRequest (field lora_path) for anything it cannot serve exactly."""
    path = Path(path)
    config = _read_config(path)
    if not (path / WEIGHTS_FILE).is_file():
        raise InvalidRequest("lora_path", f"{path} has no {WEIGHTS_FILE} (save the adapter with PEFT's "
                                          "save_pretrained, safe_serialization=True)")
    tensors = load_file(path / WEIGHTS_FILE)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.search(key)
        if ".experts." in key or ".mlp.gate." in key:
            raise InvalidRequest("lora_path", f"{path}: tensor {key} adapts a mixture-of-experts block (its "
                                              "router or experts); adapters of the attention layers are served")
        if ".linear_attn." in key:
            raise InvalidRequest("lora_path", f"{path}: tensor {key} adapts a Gated DeltaNet (linear-attention) "
                                              "projection; adapters of the full-attention and MLP projections are "
                                              "served")
        if match is None or match.group(2) not in _FUSED:
            raise InvalidRequest("lora_path", f"{path}: tensor {key} adapts something other than a decoder "
                                              "layer's projections (q/k/v/o, gate/up/down); not supported")
        layer = int(match.group(1))
        if layer >= cfg.num_hidden_layers:
            raise InvalidRequest("lora_path", f"{path}: tensor {key} is for layer {layer}; the model has "
                                              f"{cfg.num_hidden_layers}")
        if ".self_attn." in key and cfg.is_linear_layer(layer):
            raise InvalidRequest("lora_path", f"{path}: tensor {key} is for layer {layer}'s self_attn; that layer is "
                                              "a linear-attention (Gated DeltaNet) layer")
        if ".mlp." in key and cfg.is_moe_layer(layer):
            raise InvalidRequest("lora_path", f"{path}: tensor {key} adapts layer {layer}'s MLP, which is a "
                                              "mixture of experts; adapters of the attention layers are served")
        pairs.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not pairs:
        raise InvalidRequest("lora_path", f"{path}/{WEIGHTS_FILE} holds no LoRA tensors")
    sizes, rank = slice_sizes(cfg), 0
    slices: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InvalidRequest("lora_path", f"{path}: layer {layer} {proj} has lora_{''.join(ab)} but not both")
        a, b = ab["A"].float(), ab["B"].float()
        fused, part = _FUSED[proj]
        width, outs = sizes[fused]
        r = a.shape[0]
        rows = outs[part] * (2 if proj == "q_proj" and cfg.attn_output_gate else 1)  # + the gate's
        if a.shape != (r, width) or b.shape != (rows, r):
            raise InvalidRequest("lora_path", f"{path}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                                              f"{tuple(b.shape)}; this model needs [r, {width}] and [{rows}, r]")
        if r > max_rank:
            raise InvalidRequest("lora_path", f"{path}: rank {r} is above --max-lora-rank {max_rank}")
        rank = max(rank, r)
        scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        slices.setdefault((layer, fused), []).extend(_parts(cfg, proj, part, a, b * scale))
    weights = {}
    for (layer, fused), parts in slices.items():
        width, outs = sizes[fused]
        offsets = [sum(outs[:k]) for k in range(len(outs))]
        total = sum(a.shape[0] for _, a, _ in parts)
        at, bt, r0 = torch.cat([a for _, a, _ in parts]).T, torch.zeros(total, sum(outs)), 0
        for part, a, b in parts:
            bt[r0 : r0 + a.shape[0], offsets[part] : offsets[part] + outs[part]] = b.T
            r0 += a.shape[0]
        weights[(layer, fused)] = (at.to(device, dtype).contiguous(), bt.to(device, dtype).contiguous())
    log.info("LoRA adapter %s loaded from %s: rank %d, %d linears", name, path, rank, len(weights))
    return LoraAdapter(name, str(path), rank, weights)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise InvalidRequest("lora_path", f"{path} has no {CONFIG_FILE}: not a PEFT adapter directory") from None
    except (OSError, ValueError) as exc:
        raise InvalidRequest("lora_path", f"{path}/{CONFIG_FILE} cannot be read: {exc}") from None
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA is served)"),
        (config.get("use_dora"), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none", f"trained biases (bias {config.get('bias')!r})"),
        (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')}"),
        (bool(config.get("alpha_pattern")), "per-module lora_alpha (alpha_pattern)"),
        (bool(config.get("trainable_token_indices")), "trainable tokens (trainable_token_indices)"),
        (not isinstance(config.get("lora_alpha", None), (int, float)), "no numeric lora_alpha"),
    ]
    for refused, what in refusals:
        if refused:
            raise InvalidRequest("lora_path", f"{path}: the adapter uses {what}; not supported")
    return config


class LoraBatch:
    """The step's adapters: (adapter weights, rows of the step's tokens, None for all), set by the
    model runner around a forward; empty: the bare model."""

    def __init__(self):
        self.groups: list[tuple[dict, torch.Tensor | None]] = []


class LoraLinear(nn.Module):
    """A base linear plus, for each adapter of the step that adapts it, that adapter's delta on
    its rows."""

    def __init__(self, base: nn.Module, key: tuple[int, str], batch: LoraBatch):
        super().__init__()
        self.base, self.key, self.batch = base, key, batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for weights, rows in self.batch.groups:
            pair = weights.get(self.key)
            if pair is None:
                continue
            at, bt = pair
            if rows is None:
                y.addmm_(x @ at, bt)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ at) @ bt)
        return y


def install_lora(model: nn.Module) -> LoraBatch:
    """Wrap each decoder layer's four linears (two in an MoE layer) of a Qwen3ForCausalLM in a LoraLinear sharing one
    LoraBatch (after any repacking of the base linears); returns it."""
    batch = LoraBatch()
    for i, layer in enumerate(model.model.layers):
        # a linear-attention layer's projections take no adapter
        linears = [] if layer.self_attn is None else [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
        if not model.config.is_moe_layer(i):  # an MoE layer's experts take no adapter
            linears += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
        for owner, name in linears:
            setattr(owner, name, LoraLinear(getattr(owner, name), (i, name), batch))
    return batch

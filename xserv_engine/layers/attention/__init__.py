"""Paged attention behind one interface: metadata.py (what a step tells each layer), layer.py
(the module), backend.py (the interface), torch_backend.py and flash_backend.py.

A step's tokens are the prefill tokens of newly scheduled sequences followed by one token per
decoding sequence. Every layer first writes the step's new keys/values into the paged cache
(slot_mapping), then attends: prefills over their whole context (a cached prefix included),
decodes over the cache. Writing first is what lets n>1 siblings and prefix-cache hits read
prompt blocks computed in the same step.
"""

import torch

from xserv_engine.layers.attention.backend import AttentionBackend
from xserv_engine.layers.attention.flash_backend import FlashAttentionBackend
from xserv_engine.layers.attention.layer import Attention
from xserv_engine.layers.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from xserv_engine.layers.attention.torch_backend import TorchAttentionBackend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "DecodeMetadata", "FlashAttentionBackend",
           "PrefillMetadata", "TorchAttentionBackend", "select_backend"]


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: flash-attn on CUDA when it is installed, else the torch path."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    try:
        return FlashAttentionBackend()
    except ImportError:
        if name == "flash":
            raise
        return TorchAttentionBackend()

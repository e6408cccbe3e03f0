"""Paged attention behind one interface: metadata.py (what a step tells each layer), layer.py
(the module), backend.py (the interface), torch_backend.py, flash_backend.py and
triton_backend.py (CUDA without flash-attn: SDPA prefills, a Triton decode kernel).

A step's tokens are the prefill tokens of newly scheduled sequences followed by one token per
decoding sequence. Every layer first writes the step's new keys/values into the paged cache
(slot_mapping), then attends: prefills over their whole context (a cached prefix included),
decodes over the cache. Writing first is what lets n>1 siblings and prefix-cache hits read
prompt blocks computed in the same step.
"""

import logging

import torch

from xserv_engine.layers.attention.backend import AttentionBackend
from xserv_engine.layers.attention.flash_backend import FlashAttentionBackend
from xserv_engine.layers.attention.layer import Attention
from xserv_engine.layers.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata, StateMetadata
from xserv_engine.layers.attention.torch_backend import TorchAttentionBackend

log = logging.getLogger(__name__)

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "DecodeMetadata", "FlashAttentionBackend",
           "PrefillMetadata", "StateMetadata", "TorchAttentionBackend", "select_backend"]


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: on CUDA flash-attn when it is installed, else the Triton backend (Triton ships
    with CUDA builds of torch), else the torch path; on other devices the torch path. A backend
    named explicitly is that backend or an ImportError."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if name == "flash":
        return FlashAttentionBackend()
    if name == "triton":
        return _triton_backend()
    try:
        return FlashAttentionBackend()
    except ImportError:
        pass
    try:
        return _triton_backend()
    except ImportError as exc:
        log.warning("neither flash-attn nor Triton is importable (%s); CUDA decode uses the torch path", exc)
        return TorchAttentionBackend()


def _triton_backend() -> AttentionBackend:
    from xserv_engine.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()

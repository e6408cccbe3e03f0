"""Resolve `auto` device and dtype: bf16 on CUDA and on CPUs with native bf16, else fp32."""

from pathlib import Path

import torch

from xserv_engine.errors import InvalidRequest

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device", f"{name} was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise InvalidRequest("dtype", f"unknown dtype {name!r}; choose auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def cpu_has_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags

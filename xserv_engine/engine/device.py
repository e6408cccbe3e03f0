"""Resolve `auto` device and dtype: bf16 on CUDA and on CPUs with native bf16, else fp32; and
keep glibc from handing large freed blocks back to the OS while serving on the CPU."""

import ctypes
import sys
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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def retain_freed_memory() -> bool:
    """Make glibc serve large allocations from the heap and keep freed memory for reuse.

    By default glibc maps every large block (above a threshold of at most 32 MiB) fresh from the
    OS and unmaps it on free, so each step's big temporaries (logits in float32, softmax,
    cumulative sums: 39 MB each at 64 x 151,936) are page-faulted in again every time, which
    costs more than the work on them (docs/benchmarks-log.md). The price: the process keeps its
    peak memory instead of returning it (what jemalloc or tcmalloc, the usual advice for CPU
    inference with PyTorch, also do). Returns whether glibc took both settings.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    # glibc versions that cap the threshold at 32 MiB refuse 1 GiB: take the cap there
    mapped = mallopt(M_MMAP_THRESHOLD, 1 << 30) or mallopt(M_MMAP_THRESHOLD, 32 << 20)
    return bool(mapped) & bool(mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))

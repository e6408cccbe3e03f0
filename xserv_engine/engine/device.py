"""Resolve `auto` device and dtype: bf16 on CUDA and on CPUs with native bf16, else fp32; keep
glibc from handing large freed blocks back to the OS while serving on the CPU, but for what the
load freed; and back the CPU weights on 2 MB transparent huge pages."""

import ctypes
import mmap
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
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    # glibc versions that cap the threshold at 32 MiB refuse 1 GiB: take the cap there
    mapped = mallopt(M_MMAP_THRESHOLD, 1 << 30) or mallopt(M_MMAP_THRESHOLD, 32 << 20)
    return bool(mapped) & bool(mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))


def release_freed_memory() -> bool:
    """Hand the memory freed so far back to the OS (glibc's malloc_trim), once the model is loaded:
    retain_freed_memory keeps what the load frees (every unpacked weight once packed), about
    0.8 GB for Qwen3-0.6B, which serving would never reuse. Called before the warm-up, whose
    temporaries are then kept for the first steps, as the warm-up means them to be. Returns
    whether it ran."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def _glibc(name: str):
    """glibc's function `name` (ctypes), or None off Linux or where the C library is not glibc (musl
    has neither mallopt nor malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialized tensor whose memory the kernel is asked (madvise MADV_HUGEPAGE, before the
    first touch) to back with 2 MB transparent huge pages: a decode step streams every weight
    once, and 2 MB pages take 512 times fewer TLB entries than 4 KB ones (docs/benchmarks-log.md).
    THP's common default mode, `madvise`, gives huge pages only to memory that asks. Below 2 MB,
    off the CPU, off Linux, or where the kernel refuses the advice: plain torch.empty. The tensor
    holds the mapping (torch.frombuffer keeps it alive) and starts on a 2 MB boundary; the pages
    over-asked for that alignment are never touched, so they never count against the process."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if not _worth_huge_pages(nbytes, torch.device(device)):
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: not shmem
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # a kernel built without transparent huge pages
        return torch.empty(shape, dtype=dtype)
    return raw[start:start + nbytes].view(dtype).view(shape)


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` in empty_on_huge_pages' memory, bit for bit the same; the
    tensor itself where that memory would be plain (below 2 MB, off the CPU, off Linux)."""
    if not _worth_huge_pages(tensor.nbytes, tensor.device):
        return tensor
    return empty_on_huge_pages(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def _worth_huge_pages(nbytes: int, device: torch.device) -> bool:
    return (nbytes >= HUGE_PAGE and device.type == "cpu" and sys.platform.startswith("linux")
            and hasattr(mmap, "MADV_HUGEPAGE"))

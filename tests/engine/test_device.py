"""The CPU engine keeps freed memory for reuse (glibc), so big per-step temporaries are not
page-faulted in again every step, but hands back what its load freed; and holds its weights on
2 MB transparent huge pages."""

import ctypes
import sys

import pytest
import torch

from xserv_engine.engine.device import (HUGE_PAGE, empty_on_huge_pages, on_huge_pages, release_freed_memory,
                                        retain_freed_memory)
from xserv_engine.layers import int8


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL("libc.so.6"), "gnu_get_libc_version")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="mallopt settings are glibc's")
def test_glibc_takes_both_malloc_settings():
    assert retain_freed_memory() is True


def _anon_mib() -> int:
    return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))


@pytest.mark.skipif(not _glibc(), reason="malloc_trim is glibc's")
def test_memory_freed_while_retained_goes_back_to_the_os_once_released():
    assert retain_freed_memory() is True  # as every CPU engine start sets it
    release_freed_memory()  # what earlier tests of this process freed is not resident either
    before = _anon_mib()
    # 256 MiB touched, as a model's unpacked weights at load: 16 MiB each, under the mmap threshold
    # of every glibc (at most 32 MiB), so that the heap holds them
    weights = [torch.ones(4 << 20, dtype=torch.float32) for _ in range(16)]
    del weights
    retained = _anon_mib() - before
    assert retained > 200  # freed, but kept by the process
    assert release_freed_memory() is True  # as an engine start does once its model is loaded
    assert _anon_mib() - before < retained - 200


def _thp_mode() -> str:
    try:  # "always [madvise] never": the bracketed word is the mode
        return open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off in this kernel")
def test_weights_copied_to_huge_pages_are_backed_by_them_and_unchanged():
    weight = torch.randn(2048, 2048).bfloat16()  # 8 MB, four huge pages
    copy = on_huge_pages(weight)
    assert torch.equal(copy, weight) and copy.is_contiguous() and copy.data_ptr() != weight.data_ptr()
    assert copy.data_ptr() % HUGE_PAGE == 0
    # the kernel may find too few free 2 MB blocks for all four; none at all would mean no advice
    assert _anon_huge_kb(copy.data_ptr()) >= HUGE_PAGE // 1024


def test_small_weights_stay_where_they_are():
    small = torch.ones(1024, 1024, dtype=torch.uint8)  # 1 MB: a huge page would mostly be empty
    assert on_huge_pages(small) is small
    assert empty_on_huge_pages((3, 5), torch.float32).shape == (3, 5)


@pytest.mark.skipif(not int8.load_native_ops(), reason="the native int8 op needs a C++ compiler and AVX512-VNNI")
def test_int8_linear_weights_on_huge_pages_give_the_same_outputs():
    q = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    scale, x = torch.rand(2048), torch.randn(3, 2048).bfloat16()
    linear = int8.Int8Linear(q, scale, "native")
    assert linear.packed.data_ptr() % HUGE_PAGE == 0
    expected = torch.ops.xserv_cpu.int8_linear(x, torch.ops.xserv_cpu.int8_pack(q)[0], linear.comp, linear.scale, 2048)
    assert torch.equal(linear(x), expected)

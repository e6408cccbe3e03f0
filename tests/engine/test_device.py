"""The CPU engine keeps freed memory for reuse (glibc), so big per-step temporaries are not
page-faulted in again every step."""

import ctypes
import sys

import pytest

from xserv_engine.engine.device import retain_freed_memory


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL("libc.so.6"), "gnu_get_libc_version")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="mallopt settings are glibc's")
def test_glibc_takes_both_malloc_settings():
    assert retain_freed_memory() is True

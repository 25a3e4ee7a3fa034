"""Process memory as the operating system sees it: the resident set size, and returning freed heap to the OS.

Integrated mode frees memory for whoever runs next (the trainer while the rollout generates, the rollout while
the trainer trains); on a CPU-only host that only helps if freed memory actually leaves the process. Large
blocks do (glibc maps them with mmap and unmaps them on free); smaller ones stay in the heap until
`malloc_trim` hands their pages back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


def resident_bytes(pid: int | None = None) -> int:
    """The resident set size of process `pid` (this one by default) in bytes; 0 where /proc is unavailable."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only (absent from musl)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Returns the heap's free pages to the OS (glibc `malloc_trim(0)`); False where the C library lacks it."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

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


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Free memory at the top of the heap that glibc keeps instead of handing back (see keep_freed_memory).
KEEP_FREE_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Makes glibc reuse freed blocks of any size instead of unmapping them; False where it cannot.

    glibc serves blocks above its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps them on free,
    so every such tensor of a training step (the `[b, S, vocab]` logits and their softmax temporaries at W1's
    128-token responses) page-faults and zero-fills all its pages again on every micro-batch: measured 600k
    minor faults and ~2 s of system time per W1 update at 128 tokens, against 5k at 64 tokens, where the
    same tensors stay under the threshold. Serving every block from the main heap (M_MMAP_MAX 0, one arena)
    and keeping up to KEEP_FREE_BYTES free at its top (M_TRIM_THRESHOLD) makes the step reuse its pages, as a caching
    allocator does on a GPU. `release_free_memory` (malloc_trim) still hands them back on Offload. Where
    jemalloc is preloaded (the deploy images) glibc's malloc is not the one in use: this changes nothing there,
    and jemalloc already reuses freed pages.
    """
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None  # glibc only (absent from musl)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # One arena: a thread's own arena (the trainer runs its operations on a worker thread) would still
    # mmap its large blocks; the main heap honours the two settings above. Threads that allocated before
    # this call keep their arena, so it is made before the process starts its threads.
    return all(mallopt(k, v) for k, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, KEEP_FREE_BYTES)))

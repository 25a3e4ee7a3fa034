"""Checksums of weight updates: per tensor, per bucket, per commit.

A tensor's checksum folds the wrapping 64-bit sum of its bytes read as little-endian u64 words (the last,
partial word zero-padded) together with its byte length, through CRC-32. The word sum is one vectorised
pass at memory speed (30-47 GB/s on the 2-core machines, against 3 GB/s for zlib's CRC-32 over the same
bytes), so a sender that packs and a receiver that verifies each read the bytes once for it, and the
copy a transport makes anyway dominates. It detects every single-bit error and any change of one word; it
does not detect two aligned 8-byte words swapped inside one tensor (transports move whole buffers, never
words). A bucket's checksum chains its tensors' checksums in order with CRC-32, and a commit's checksum
chains the bucket checksums in index order, so order matters across tensors and buckets and a receiver
verifies an update without re-reading the bytes.

The word sum is a sum, so it can be taken in steps: `copy_word_sum` copies a buffer in `CHUNK_BYTES` steps
and sums each step's landed bytes while they are still in cache (the sum then costs a fraction of a pass
over memory), and the replica's checks do the same with their two sums (services/rollout/weight_checks.py).
Steps are whole words, so a stepped sum equals the one-pass sum of the same bytes.

Where the package was built with its C extension (`_wordcopy.c`, `NATIVE`), the copies and the replica's
checks run there instead: each word is loaded once, stored, summed and tested for an all-ones exponent in
registers, so a copy with its checksum and finiteness test costs less than glibc's memcpy alone on these
machines (35 vs 48 ms for 575 MiB; the torch path: 52 ms for the copy and sum, 61 with the finiteness
sum). Without a C compiler at install time the torch path gives the same checksums.
"""

from __future__ import annotations

import math
import struct
import warnings
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from rlfabric.v1 import common_pb2

try:
    from services.common import _wordcopy
except ImportError:  # built without a C compiler (setup.py): the torch path below
    _wordcopy = None

NATIVE = _wordcopy is not None
# The native kernels' element layouts, by dtype (_wordcopy.c): the exponent they test for all ones.
_KINDS = {torch.float64: 8, torch.float32: 4, torch.bfloat16: 2, torch.float16: -2}

_MASK64 = (1 << 64) - 1
# Bytes per step of a cache-blocked pass: a multiple of 8 (and of every element size) that stays in the
# 32 MiB L3 with room to spare; 2 MiB measured fastest (0.5-4 MiB within 10%) on the 2-core machines,
# where smaller steps pay more per-call overhead than they save.
CHUNK_BYTES = 2 << 20


def tensor_word_sum(raw: torch.Tensor) -> int:
    """`word_sum` of a 1-D contiguous uint8 tensor."""
    if raw.storage_offset() % 8:
        raw = torch.from_numpy(raw.numpy())  # the same bytes, a storage starting at them (int64 views need that)
    n = raw.numel()
    head = n - n % 8
    # torch's int64 sum wraps like u64 arithmetic and is the fastest reduction here (30-47 GB/s
    # single-threaded, numpy's 30): the checksum costs a fraction of the copy it rides along with.
    total = int(raw[:head].view(torch.int64).sum()) if head else 0
    if head < n:
        total += int.from_bytes(raw[head:].numpy().tobytes(), "little")
    return total & _MASK64


def word_sum(data: Any) -> int:
    """Wrapping sum of the bytes of `data` (any buffer) as little-endian u64 words, the tail zero-padded."""
    raw = memoryview(data).cast("B")
    if not len(raw):
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: the sum only reads
        return tensor_word_sum(torch.frombuffer(raw, dtype=torch.uint8))


def copy_word_sum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copies the 1-D uint8 tensor `src` into the contiguous `dst` (same size) and returns
    the word sum of the bytes that landed, summing each `CHUNK_BYTES` step while it is in cache."""
    if dst.numel() != src.numel():
        raise ValueError(f"cannot copy {src.numel()} bytes into {dst.numel()}")
    # numpy's copy is glibc's memcpy: 15% faster than torch's copy_ on these machines.
    to, frm = dst.numpy(), src.numpy()
    if _wordcopy is not None:
        return _wordcopy.copy_sum(to, frm)
    total = 0
    for i in range(0, src.numel(), CHUNK_BYTES):
        np.copyto(to[i:i + CHUNK_BYTES], frm[i:i + CHUNK_BYTES])
        total += tensor_word_sum(dst[i:i + CHUNK_BYTES])
    return total & _MASK64


def word_sum_and_finite(tensor: torch.Tensor) -> tuple[int, bool]:
    """The word sum of a contiguous float tensor's bytes, and False when it may hold inf or NaN (then the
    caller checks exactly). One pass over memory: natively both at once; otherwise an int64 and a float sum of
    each `CHUNK_BYTES` step in turn, so the float sum reads the step from cache (a float sum is not finite
    for NaN, inf, or finite values whose sum overflowed)."""
    flat = tensor.detach().reshape(-1)
    kind = _KINDS.get(flat.dtype)
    if _wordcopy is not None and kind is not None:
        total, nonfinite = _wordcopy.sum_nonfinite(flat.view(torch.uint8).numpy(), kind)
        return total, not nonfinite
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    step = CHUNK_BYTES // flat.element_size()
    total, finite = 0, True
    for i in range(0, flat.numel(), step):
        part = flat[i:i + step]
        total += tensor_word_sum(part.view(torch.uint8))
        finite = finite and math.isfinite(float(part.sum(dtype=acc)))
    return total & _MASK64, finite


def copy_word_sum_and_finite(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, bool]:
    """Copies the contiguous float tensor `src` into `dst` (contiguous, same dtype and size) and returns
    `word_sum_and_finite` of the bytes that landed, each step checked right after its copy while in cache."""
    to, frm = dst.detach().reshape(-1), src.detach().reshape(-1)
    if to.dtype != frm.dtype or to.numel() != frm.numel():
        raise ValueError(f"cannot copy {frm.numel()} x {frm.dtype} into {to.numel()} x {to.dtype}")
    kind = _KINDS.get(to.dtype)
    if _wordcopy is not None and kind is not None:
        total, nonfinite = _wordcopy.copy_sum_nonfinite(to.view(torch.uint8).numpy(), frm.view(torch.uint8).numpy(),
                                                        kind)
        return total, not nonfinite
    acc = torch.float64 if to.dtype == torch.float64 else torch.float32
    step = CHUNK_BYTES // to.element_size()
    dst_np, src_np = to.view(torch.uint8).numpy(), frm.view(torch.uint8).numpy()
    total, finite = 0, True
    for i in range(0, to.numel(), step):
        b0, b1 = i * to.element_size(), (i + step) * to.element_size()
        np.copyto(dst_np[b0:b1], src_np[b0:b1])
        part = to[i:i + step]
        total += tensor_word_sum(part.view(torch.uint8))
        finite = finite and math.isfinite(float(part.sum(dtype=acc)))
    return total & _MASK64, finite


def fold(total: int, nbytes: int) -> int:
    """The 32-bit tensor checksum of a word sum `total` over `nbytes` bytes."""
    return zlib.crc32(struct.pack("<QQ", total & _MASK64, nbytes)) & 0xFFFFFFFF


def data_checksum(data: Any) -> int:
    """The tensor checksum of a buffer's bytes."""
    return fold(word_sum(data), memoryview(data).nbytes)


def chain(checksums: Iterable[int]) -> int:
    """Order-dependent combination of 32-bit checksums (a bucket's from its tensors, a commit's from buckets)."""
    crc = 0
    for c in checksums:
        crc = zlib.crc32(struct.pack("<I", c & 0xFFFFFFFF), crc)
    return crc & 0xFFFFFFFF


def bucket_checksum(tensors: Iterable[common_pb2.NamedTensor]) -> int:
    """The checksum of a bucket whose tensors carry their bytes in `data`."""
    return chain(data_checksum(named.tensor.data) for named in tensors)


def combine_checksums(checksums: Sequence[int]) -> int:
    """A commit's checksum from its bucket checksums in index order."""
    return chain(checksums)

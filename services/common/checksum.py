"""Checksums of weight updates: per tensor, per bucket, per commit (specified in protos/rlfabric/v1/common.proto,
WeightBucket.checksum).

A tensor's checksum folds two 64-bit sums of its bytes read as little-endian u64 words w_0..w_{N-1} (the
last, partial word zero-padded) together with its byte length, through CRC-32: s1 = sum of w_i and
s2 = sum of (N - i) * w_i, both mod 2^64 -- what `s1 += w; s2 += s1` gives over the words in order
(Fletcher's second sum). s2 depends on each word's place: two words i < j swapped, or two chunks of one
tensor written at each other's offsets, change it by (j - i)(w_i - w_j), which is zero mod 2^64 only when
that product has 64 trailing zero bits (equal words, or distances and differences that are both multiples
of large powers of two). Natively both sums ride along with the copy a transport makes anyway, at memory
speed, so a sender that packs and a receiver that verifies each read the bytes once for them. A
bucket's checksum chains its tensors' checksums in order with CRC-32, and a commit's checksum chains the
bucket checksums in index order, so order matters across tensors and buckets and a receiver verifies an
update without re-reading the bytes.

The sums can be taken in steps (`chain_sums`: a run of m words appended to the words before it adds m * s1
of those to s2): `copy_word_sum` copies a buffer in `CHUNK_BYTES` steps and sums each step's landed bytes
while they are still in cache (the sums then cost a fraction of a pass over memory), and the replica's
checks do the same with their float sum (services/rollout/weight_checks.py). Steps are whole words, so a
stepped sum equals the one-pass sum of the same bytes.

Where the package was built with its C extension (`_wordcopy.c`, `NATIVE`), the copies and the replica's
checks run there instead: each word is loaded once, stored, summed and tested for an all-ones exponent in
registers, so a copy with its checksum and finiteness test costs about what glibc's memcpy costs on these
machines (bench/bench_weight_sync.py). Without a C compiler at install time the torch path gives the same
checksums, slower (its second sum is a running sum and a sum per step).
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
Sums = tuple[int, int]  # (s1, s2) of a run of words (module docstring)
# Bytes per step of a cache-blocked pass: a multiple of 8 (and of every element size) that stays in the
# 32 MiB L3 with room to spare; 2 MiB measured fastest (0.5-4 MiB within 10%) on the 2-core machines,
# where smaller steps pay more per-call overhead than they save.
CHUNK_BYTES = 2 << 20


def chain_sums(before: Sums, run: Sums, run_words: int) -> Sums:
    """The sums of the words of `before` followed by a run of `run_words` words whose own sums are `run`."""
    return (before[0] + run[0]) & _MASK64, (before[1] + run_words * before[0] + run[1]) & _MASK64


def _words_sums(words: torch.Tensor) -> Sums:
    """The sums of a non-empty int64 tensor of words."""
    # The running sums are the second sum's terms and the last of them the first sum: one cumsum and one sum
    # (torch's int64 arithmetic wraps like u64's), 2-4x faster here than a multiply by the words' weights.
    prefix = words.cumsum(0)
    return int(prefix[-1]) & _MASK64, int(prefix.sum()) & _MASK64


def tensor_word_sum(raw: torch.Tensor) -> Sums:
    """The word sums (s1, s2) of a 1-D contiguous uint8 tensor."""
    if _wordcopy is not None:
        s1, s2, _ = _wordcopy.sum_nonfinite(raw.numpy(), 0)  # kind 0: bytes, no finiteness test
        return s1, s2
    if raw.storage_offset() % 8:
        raw = torch.from_numpy(raw.numpy())  # the same bytes, a storage starting at them (int64 views need that)
    n = raw.numel()
    head = n - n % 8
    sums: Sums = (0, 0)
    for i in range(0, head, CHUNK_BYTES):
        words = raw[i:min(head, i + CHUNK_BYTES)].view(torch.int64)
        sums = chain_sums(sums, _words_sums(words), words.numel())
    if head < n:
        sums = chain_sums(sums, (int.from_bytes(raw[head:].numpy().tobytes(), "little"),) * 2, 1)
    return sums


def word_sum(data: Any) -> Sums:
    """The word sums (s1, s2) of the bytes of `data` (any buffer)."""
    raw = memoryview(data).cast("B")
    if not len(raw):
        return 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: the sum only reads
        return tensor_word_sum(torch.frombuffer(raw, dtype=torch.uint8))


def copy_word_sum(dst: torch.Tensor, src: torch.Tensor) -> Sums:
    """Copies the 1-D uint8 tensor `src` into the contiguous `dst` (same size) and returns
    the word sums of the bytes that landed, summing each `CHUNK_BYTES` step while it is in cache."""
    if dst.numel() != src.numel():
        raise ValueError(f"cannot copy {src.numel()} bytes into {dst.numel()}")
    # numpy's copy is glibc's memcpy: 15% faster than torch's copy_ on these machines.
    to, frm = dst.numpy(), src.numpy()
    if _wordcopy is not None:
        return _wordcopy.copy_sum(to, frm)
    sums: Sums = (0, 0)
    for i in range(0, src.numel(), CHUNK_BYTES):
        np.copyto(to[i:i + CHUNK_BYTES], frm[i:i + CHUNK_BYTES])
        step = dst[i:i + CHUNK_BYTES]
        sums = chain_sums(sums, tensor_word_sum(step), -(-step.numel() // 8))
    return sums


def word_sum_and_finite(tensor: torch.Tensor) -> tuple[Sums, bool]:
    """The word sums of a contiguous float tensor's bytes, and False when it may hold inf or NaN (then the
    caller checks exactly). One pass over memory: natively both at once; otherwise an int64 and a float sum of
    each `CHUNK_BYTES` step in turn, so the float sum reads the step from cache (a float sum is not finite
    for NaN, inf, or finite values whose sum overflowed)."""
    flat = tensor.detach().reshape(-1)
    kind = _KINDS.get(flat.dtype)
    if _wordcopy is not None and kind is not None:
        s1, s2, nonfinite = _wordcopy.sum_nonfinite(flat.view(torch.uint8).numpy(), kind)
        return (s1, s2), not nonfinite
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    step = CHUNK_BYTES // flat.element_size()
    sums: Sums = (0, 0)
    finite = True
    for i in range(0, flat.numel(), step):
        part = flat[i:i + step]
        sums = chain_sums(sums, tensor_word_sum(part.view(torch.uint8)), -(-part.numel() * part.element_size() // 8))
        finite = finite and math.isfinite(float(part.sum(dtype=acc)))
    return sums, finite


def copy_word_sum_and_finite(dst: torch.Tensor, src: torch.Tensor) -> tuple[Sums, bool]:
    """Copies the contiguous float tensor `src` into `dst` (contiguous, same dtype and size) and returns
    `word_sum_and_finite` of the bytes that landed, each step checked right after its copy while in cache."""
    to, frm = dst.detach().reshape(-1), src.detach().reshape(-1)
    if to.dtype != frm.dtype or to.numel() != frm.numel():
        raise ValueError(f"cannot copy {frm.numel()} x {frm.dtype} into {to.numel()} x {to.dtype}")
    kind = _KINDS.get(to.dtype)
    if _wordcopy is not None and kind is not None:
        s1, s2, nonfinite = _wordcopy.copy_sum_nonfinite(to.view(torch.uint8).numpy(),
                                                         frm.view(torch.uint8).numpy(), kind)
        return (s1, s2), not nonfinite
    acc = torch.float64 if to.dtype == torch.float64 else torch.float32
    step = CHUNK_BYTES // to.element_size()
    dst_np, src_np = to.view(torch.uint8).numpy(), frm.view(torch.uint8).numpy()
    sums: Sums = (0, 0)
    finite = True
    for i in range(0, to.numel(), step):
        b0, b1 = i * to.element_size(), (i + step) * to.element_size()
        np.copyto(dst_np[b0:b1], src_np[b0:b1])
        part = to[i:i + step]
        sums = chain_sums(sums, tensor_word_sum(part.view(torch.uint8)), -(-part.numel() * part.element_size() // 8))
        finite = finite and math.isfinite(float(part.sum(dtype=acc)))
    return sums, finite


def fold(sums: Sums, nbytes: int) -> int:
    """The 32-bit tensor checksum of the word sums `sums` of `nbytes` bytes: CRC-32 of s1, s2 and nbytes as
    little-endian u64s."""
    return zlib.crc32(struct.pack("<QQQ", sums[0] & _MASK64, sums[1] & _MASK64, nbytes)) & 0xFFFFFFFF


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

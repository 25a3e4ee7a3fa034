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
"""

from __future__ import annotations

import struct
import warnings
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlfabric.v1 import common_pb2

_MASK64 = (1 << 64) - 1


def word_sum(data: Any) -> int:
    """Wrapping sum of the bytes of `data` (any buffer) as little-endian u64 words, the tail zero-padded.

    torch's int64 sum wraps like u64 arithmetic and is the fastest reduction here (30-47 GB/s single-threaded,
    numpy's 30): the checksum costs a fraction of the copy it rides along with.
    """
    raw = memoryview(data).cast("B")
    head = len(raw) - len(raw) % 8
    total = 0
    if head:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers: the sum only reads
            total = int(torch.frombuffer(raw[:head], dtype=torch.int64).sum())
    if head < len(raw):
        total += int.from_bytes(bytes(raw[head:]), "little")
    return total & _MASK64


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

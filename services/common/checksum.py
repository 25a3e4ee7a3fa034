"""Checksums of weight buckets and commits (CRC-32, zlib polynomial).

A bucket's checksum runs over the `data` bytes of its tensors in order; a commit's checksum chains the
bucket checksums in index order, so a receiver can verify an update without re-reading the bytes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Sequence

from rlfabric.v1 import common_pb2


def bucket_checksum(tensors: Iterable[common_pb2.NamedTensor]) -> int:
    crc = 0
    for named in tensors:
        crc = zlib.crc32(named.tensor.data, crc)
    return crc & 0xFFFFFFFF


def combine_checksums(checksums: Sequence[int]) -> int:
    crc = 0
    for c in checksums:
        crc = zlib.crc32(struct.pack("<I", c & 0xFFFFFFFF), crc)
    return crc & 0xFFFFFFFF

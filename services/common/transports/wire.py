"""Bucket chunks whose tensor bytes stay in the source tensors until gRPC serializes them.

Packing a bucket the protobuf way copies every byte three times before gRPC copies it once more
(`tobytes`, setting the `data` field, `SerializeToString`). A `PackedChunk` keeps the metadata in a
`WeightUpdateChunk` without `data` and the bytes as views of the source tensors; `encode()` writes the
wire format of the full message in one `b"".join`, so each byte is copied once before gRPC takes it.
The encoding relies on protobuf's rules: fields may appear in any order and repeated message fields are
concatenated, so a message serialized without field N followed by field N's bytes parses as one message
(tests/weight_sync/test_wire.py checks the bytes against protobuf's own encoding).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlfabric.v1 import common_pb2, rollout_pb2

_LEN = 2  # wire type of length-delimited fields


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _tag(field: int) -> bytes:
    return _varint(field << 3 | _LEN)


def _field(field: int, payload_len: int) -> bytes:
    return _tag(field) + _varint(payload_len)


@dataclasses.dataclass
class PackedChunk:
    """A bucket chunk: `message` has every field but the tensors' `data`, which `views` hold (uint8 arrays)."""

    message: rollout_pb2.WeightUpdateChunk
    views: list[np.ndarray]

    @property
    def bucket(self) -> common_pb2.WeightBucket:
        return self.message.bucket

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf spelling, so callers treat both alike
        return self.message.HasField(name)

    def materialize(self) -> rollout_pb2.WeightUpdateChunk:
        """The full protobuf message (copies the bytes; for tests and the tamper hook)."""
        full = rollout_pb2.WeightUpdateChunk()
        full.CopyFrom(self.message)
        for named, view in zip(full.bucket.tensors, self.views, strict=True):
            named.tensor.data = view.tobytes()
        return full

    def encode(self) -> bytes:
        """The serialized full message, with one copy of the tensor bytes."""
        head = common_pb2.WeightBucket()
        head.CopyFrom(self.message.bucket)
        del head.tensors[:]
        parts: list = [head.SerializeToString()]
        for named, view in zip(self.message.bucket.tensors, self.views, strict=True):
            tensor_head = named.tensor.SerializeToString()  # dtype and shape; `data` is empty
            tensor_len = len(tensor_head) + len(_field(3, view.nbytes)) + view.nbytes
            name = common_pb2.NamedTensor(name=named.name).SerializeToString()
            named_len = len(name) + len(_field(2, tensor_len)) + tensor_len
            parts += [_field(3, named_len), name, _field(2, tensor_len), tensor_head, _field(3, view.nbytes),
                      memoryview(view)]
        bucket_len = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        return b"".join([_field(1, bucket_len), *parts])


def serialize(chunk: PackedChunk | rollout_pb2.WeightUpdateChunk) -> bytes:
    """The UpdateWeights request serializer: packed chunks encode themselves, messages serialize."""
    return chunk.encode() if isinstance(chunk, PackedChunk) else chunk.SerializeToString()

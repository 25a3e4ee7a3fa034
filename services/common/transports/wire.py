"""Bucket chunks whose tensor bytes stay in the source tensors until gRPC serializes them.

Packing a bucket the protobuf way copies every byte three times before gRPC copies it once more
(`tobytes`, setting the `data` field, `SerializeToString`). A `PackedChunk` keeps the metadata in a
`WeightUpdateChunk` without `data` and the bytes as views of the source tensors; `encode()` writes the
wire format of the full message into one new bytes object, so each byte is copied once before gRPC takes
it, and that copy also takes the bytes' checksums (the sender reads them once). The encoding relies on
protobuf's rules: fields may appear in any order and repeated message fields are concatenated, so a
message serialized without field N followed by field N's bytes parses as one message
(tests/weight_sync/test_wire.py checks what protobuf parses from it).

The receiver's side is the mirror image: `decode_chunk`, the UpdateWeights request deserializer
(`receiving_views` installs it), parses a bucket's small fields with protobuf and keeps each tensor's bytes as
a view of the received request, so the only copies on the replica are the one into the engine's parameters and
the backup of the values it overwrites (services/rollout/update_stream.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import torch

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.checksum import chain, copy_word_sum, data_checksum, fold

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
    """A bucket chunk: `message` has every field but the tensors' `data`, which `views` hold (uint8 arrays).

    The bucket's checksum is taken by `encode` while it copies the bytes into the message (one pass over them),
    or from the views when `bucket` is read first (then `encode` sends that value, as set)."""

    message: rollout_pb2.WeightUpdateChunk
    views: list[np.ndarray]
    _summed: bool = dataclasses.field(default=False, repr=False)

    @property
    def bucket(self) -> common_pb2.WeightBucket:
        if not self._summed:
            self._set_checksum(chain(data_checksum(view) for view in self.views))
        return self.message.bucket

    def _set_checksum(self, checksum: int) -> None:
        self.message.bucket.checksum = checksum
        self._summed = True

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf spelling, so callers treat both alike
        return self.message.HasField(name)

    def materialize(self) -> rollout_pb2.WeightUpdateChunk:
        """The full protobuf message (copies the bytes; for tests and the tamper hook)."""
        full = rollout_pb2.WeightUpdateChunk()
        full.bucket.CopyFrom(self.bucket)
        for named, view in zip(full.bucket.tensors, self.views, strict=True):
            named.tensor.data = view.tobytes()
        return full

    def encode(self) -> bytes:
        """The serialized full message, with one copy of the tensor bytes that also takes their checksums.

        The bucket's `checksum` field is written last, after the bytes it covers (protobuf reads fields in any
        order), as a varint padded to its full five bytes so that the message's length is known before the
        checksum is: parsers accept such varints (the wire format allows up to ten bytes)."""
        bucket = self.message.bucket
        head = common_pb2.WeightBucket()
        head.CopyFrom(bucket)
        del head.tensors[:]
        head.ClearField("checksum")
        parts: list = [head.SerializeToString()]
        for named, view in zip(bucket.tensors, self.views, strict=True):
            tensor_head = named.tensor.SerializeToString()  # dtype and shape; `data` is empty
            tensor_len = len(tensor_head) + len(_field(3, view.nbytes)) + view.nbytes
            name = common_pb2.NamedTensor(name=named.name).SerializeToString()
            named_len = len(name) + len(_field(2, tensor_len)) + tensor_len
            parts += [_field(3, named_len), name, _field(2, tensor_len), tensor_head, _field(3, view.nbytes), view]
        parts.append(bytes(CHECKSUM_TRAILER_BYTES))  # filled in once the bytes are summed
        bucket_len = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        out, dst, sums = _fill([_field(1, bucket_len), *parts])
        if not self._summed:
            self._set_checksum(chain(fold(total, view.nbytes) for total, view in zip(sums, self.views, strict=True)))
        dst[-CHECKSUM_TRAILER_BYTES:] = np.frombuffer(_CHECKSUM_KEY + _padded_varint(bucket.checksum), dtype=np.uint8)
        return out


_CHECKSUM_KEY = _varint(4 << 3)  # WeightBucket.checksum, a varint (wire type 0)
_CHECKSUM_VARINT = 5  # bytes of a uint32 varint at its longest
# What an encoded bucket ends with after its last tensor's bytes: the checksum's key and padded varint.
CHECKSUM_TRAILER_BYTES = len(_CHECKSUM_KEY) + _CHECKSUM_VARINT


def _padded_varint(n: int) -> bytes:
    """`n` (< 2**32) as a five-byte varint: continuation bits on the first four bytes, whatever their value."""
    return bytes([(n >> 7 * i & 0x7F) | 0x80 for i in range(4)] + [n >> 28])


# Messages of at least this size get their pages advised as transparent huge pages.
_HUGE_FROM = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _fill(parts: list) -> tuple[bytes, np.ndarray, list[int]]:
    """A new bytes object holding `parts` in order (bytes, and uint8 arrays copied with their word sums taken on
    the way: checksum.copy_word_sum), a writable view of it for the caller's last touches, and the arrays' sums.

    The object is created empty (`PyBytes_FromStringAndSize(NULL, n)`, which the C API lets its creator fill
    before anyone else sees it). Every bucket is a new message of 16 MiB or more, and glibc hands most of them
    out as fresh pages: faulting them 4 KiB at a time cost the sender more system time than the copy (40k
    faults per push of 575 MB), so a large message's pages are advised as huge (THP in `madvise` mode, as here
    and on most distributions; elsewhere the advice does nothing)."""
    total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    out = _new_bytes(None, total)
    addr = _bytes_data(out)
    if total >= _HUGE_FROM and _LIBC is not None:
        start, end = -(-addr // _HUGE_PAGE) * _HUGE_PAGE, (addr + total) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            _LIBC.madvise(start, end - start, _MADV_HUGEPAGE)  # a hint: failure only means 4 KiB pages
    dst = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(addr))  # never empty: a bucket has a header
    at, sums = 0, []
    for part in parts:
        if isinstance(part, bytes):
            dst[at:at + len(part)] = np.frombuffer(part, dtype=np.uint8)
            at += len(part)
        else:
            sums.append(copy_word_sum(torch.from_numpy(dst[at:at + part.nbytes]), torch.from_numpy(part)))
            at += part.nbytes
    return out, dst, sums


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype, _bytes_data.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def serialize(chunk: PackedChunk | rollout_pb2.WeightUpdateChunk | bytes) -> bytes:
    """The UpdateWeights request serializer: packed chunks encode themselves, messages serialize, bytes (a
    chunk the sender serialized already) pass through."""
    if isinstance(chunk, bytes):
        return chunk
    return chunk.encode() if isinstance(chunk, PackedChunk) else chunk.SerializeToString()


# --- the receiver's side -------------------------------------------------------------------------------------


class _MalformedError(ValueError):
    pass


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _MalformedError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview, start: int, end: int):
    """(field number, wire type, start of the field's key, payload start, payload end) of each field."""
    pos = start
    while pos < end:
        key_at = pos
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, stop = _read_varint(buf, pos)
            yield field, wire, key_at, pos, stop
        elif wire == _LEN:
            n, pos = _read_varint(buf, pos)
            yield field, wire, key_at, pos, pos + n
            stop = pos + n
        elif wire in (1, 5):
            stop = pos + (8 if wire == 1 else 4)
            yield field, wire, key_at, pos, stop
        else:
            raise _MalformedError(f"wire type {wire}")
        if stop > end:
            raise _MalformedError("field beyond its message")
        pos = stop


@dataclasses.dataclass
class ReceivedChunk:
    """A received bucket chunk: `message` without the tensors' `data`, `data` the bytes as views of the
    received request (no copy), in tensor order."""

    message: rollout_pb2.WeightUpdateChunk
    data: list[memoryview]

    @property
    def bucket(self) -> common_pb2.WeightBucket:
        return self.message.bucket

    def WhichOneof(self, name: str) -> str | None:  # noqa: N802 - the protobuf spelling
        return self.message.WhichOneof(name)


def _split_tensor(buf: memoryview, start: int, end: int) -> tuple[bytes, memoryview]:
    """A Tensor's bytes without `data`, and `data` as a view."""
    head, data = [], buf[0:0]
    for field, wire, key_at, a, b in _fields(buf, start, end):
        if field == 3 and wire == _LEN:
            data = buf[a:b]
        else:
            head.append(buf[key_at:b])
    return b"".join(head), data


def _split_named(buf: memoryview, start: int, end: int) -> tuple[bytes, memoryview]:
    head, data = [], buf[0:0]
    for field, wire, key_at, a, b in _fields(buf, start, end):
        if field == 2 and wire == _LEN:
            tensor, data = _split_tensor(buf, a, b)
            head += [_field(2, len(tensor)), tensor]
        else:
            head.append(buf[key_at:b])
    return b"".join(head), data


def decode_chunk(raw: bytes) -> ReceivedChunk | rollout_pb2.WeightUpdateChunk:
    """The UpdateWeights request deserializer: bucket chunks keep their tensor bytes in `raw` (views); anything
    else, or anything this walk does not understand, is left to protobuf."""
    buf = memoryview(raw)
    try:
        top = list(_fields(buf, 0, len(buf)))
        if len(top) != 1 or top[0][:2] != (1, _LEN):
            return rollout_pb2.WeightUpdateChunk.FromString(raw)
        head, data = [], []
        for field, wire, key_at, a, b in _fields(buf, top[0][3], top[0][4]):
            if field == 3 and wire == _LEN:
                named, view = _split_named(buf, a, b)
                head += [_field(3, len(named)), named]
                data.append(view)
            else:
                head.append(buf[key_at:b])
        message = rollout_pb2.WeightUpdateChunk(bucket=common_pb2.WeightBucket.FromString(b"".join(head)))
    except _MalformedError:
        return rollout_pb2.WeightUpdateChunk.FromString(raw)  # raises protobuf's own DecodeError
    return ReceivedChunk(message, data)


class _ViewsServer:
    """Stands in for the server while generated code registers a service's handlers: `method` gets the
    decode_chunk deserializer."""

    def __init__(self, server: grpc.Server, method: str) -> None:
        self._server, self._method = server, method

    def add_generic_rpc_handlers(self, _handlers) -> None:
        pass  # registered from the same table in add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        handlers = dict(handlers)
        old = handlers[self._method]
        handlers[self._method] = grpc.stream_unary_rpc_method_handler(
            old.stream_unary, request_deserializer=decode_chunk, response_serializer=old.response_serializer)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)


def receiving_views(add_fn: Callable[[Any, grpc.Server], None], method: str) -> Callable[[Any, grpc.Server], None]:
    """A generated `add_XServicer_to_server` whose client-streaming `method` decodes with `decode_chunk`."""
    return lambda servicer, server: add_fn(servicer, _ViewsServer(server, method))

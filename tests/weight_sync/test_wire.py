"""The one-copy bucket encoding (services/common/transports/wire.py) is protobuf's wire format."""

from __future__ import annotations

import torch

from rlfabric.v1 import rollout_pb2
from services.common.checksum import bucket_checksum
from services.common.transports.grpc_stream import GrpcStreamTransport
from services.common.transports.wire import PackedChunk, serialize


def test_packed_chunks_parse_as_the_full_messages():
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 7, generator=gen), "b.weight": torch.randn(5, generator=gen).to(torch.bfloat16),
               "c": torch.zeros(0, 3), "big": torch.randn(70_000, generator=gen)}  # lengths over 1, 2 and 3 varint bytes
    chunks = list(GrpcStreamTransport(["x:1"], bucket_bytes=1 << 10).buckets(300, iter(tensors.items())))
    assert len(chunks) == 3  # "a" alone, "b" + "c", "big" alone
    names = []
    for chunk, _ in chunks:
        assert isinstance(chunk, PackedChunk)
        parsed = rollout_pb2.WeightUpdateChunk.FromString(serialize(chunk))
        assert parsed == chunk.materialize()
        assert parsed.bucket.checksum == bucket_checksum(parsed.bucket.tensors)
        for named in parsed.bucket.tensors:
            names.append(named.name)
            source = tensors[named.name]
            assert list(named.tensor.shape) == list(source.shape)
            assert named.tensor.data == source.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert names == list(tensors)
    commit = rollout_pb2.WeightUpdateChunk()
    commit.commit.version = 300
    assert serialize(commit) == commit.SerializeToString()


def test_received_chunks_keep_the_bytes_as_views_and_the_rest_as_protobuf():
    import pytest
    from google.protobuf.message import DecodeError

    from services.common.transports.wire import ReceivedChunk, decode_chunk

    tensors = {"w": torch.arange(40_000, dtype=torch.float32).reshape(200, 200), "e": torch.zeros(0),
               "h": torch.ones(3, dtype=torch.float16)}
    (chunk, _), = list(GrpcStreamTransport(["x:1"]).buckets(9, iter(tensors.items())))
    received = decode_chunk(serialize(chunk))
    assert isinstance(received, ReceivedChunk) and received.WhichOneof("kind") == "bucket"
    assert received.bucket.version == 9 and received.bucket.checksum == chunk.bucket.checksum
    assert received.message == chunk.message  # every field but `data`, which the views hold
    assert [bytes(d) for d in received.data] == [t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                                 for t in tensors.values()]
    commit = rollout_pb2.WeightUpdateChunk()
    commit.commit.version, commit.commit.num_buckets = 9, 1
    assert decode_chunk(commit.SerializeToString()) == commit
    with pytest.raises(DecodeError):
        decode_chunk(serialize(chunk)[:-5])  # truncated: protobuf's own error


def test_large_messages_filled_in_place_parse_as_the_full_messages():
    from services.common.transports import wire

    gen = torch.Generator().manual_seed(1)
    tensors = {"big": torch.randn(3 << 20, generator=gen), "small": torch.randn(7, generator=gen)}  # 12 MiB + 28 B
    (chunk, _), = list(GrpcStreamTransport(["x:1"], bucket_bytes=64 << 20).buckets(5, iter(tensors.items())))
    payload = serialize(chunk)
    assert len(payload) >= wire._HUGE_FROM  # pages advised as huge
    parsed = rollout_pb2.WeightUpdateChunk.FromString(payload)
    assert parsed == chunk.materialize()
    source = {n: t.view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}
    assert {n.name: n.tensor.data for n in parsed.bucket.tensors} == source
    tensors["big"][0] += 1  # the message owns its bytes: later writes to the source do not reach it
    assert rollout_pb2.WeightUpdateChunk.FromString(payload) == parsed


def _chunk(tensors: dict[str, torch.Tensor]):
    (chunk, _), = list(GrpcStreamTransport(["x:1"]).buckets(2, iter(tensors.items())))
    return chunk


def test_the_checksum_taken_while_encoding_is_the_one_of_the_bytes_and_goes_last_as_five_bytes():
    gen = torch.Generator().manual_seed(2)
    tensors = {"w": torch.randn(999, generator=gen), "odd": torch.randn(3, generator=gen).to(torch.float16)}
    chunk = _chunk(tensors)
    payload = serialize(chunk)  # nothing read the checksum before: the copy took it
    parsed = rollout_pb2.WeightUpdateChunk.FromString(payload)
    assert parsed.bucket.checksum == bucket_checksum(parsed.bucket.tensors) == chunk.bucket.checksum
    from services.common.transports.wire import _CHECKSUM_KEY, CHECKSUM_TRAILER_BYTES, _padded_varint
    assert _CHECKSUM_KEY == b"\x20"  # field 4, varint
    assert payload[-CHECKSUM_TRAILER_BYTES:] == _CHECKSUM_KEY + _padded_varint(parsed.bucket.checksum)
    # Every value fits five bytes, small ones too (the continuation bits pad them), and parses back.
    from rlfabric.v1 import common_pb2
    for value in (0, 1, 127, 128, 1 << 28, (1 << 32) - 1):
        assert common_pb2.WeightBucket.FromString(b"\x20" + _padded_varint(value)).checksum == value
        assert len(_padded_varint(value)) == 5


def test_a_checksum_read_or_set_before_encoding_is_the_one_sent():
    tensors = {"w": torch.arange(64, dtype=torch.float32)}
    honest = _chunk(tensors)
    assert rollout_pb2.WeightUpdateChunk.FromString(serialize(honest)).bucket.checksum == honest.bucket.checksum
    tampered = _chunk(tensors)
    tampered.bucket.checksum ^= 0xFF  # as a test corrupting the sent checksum does
    parsed = rollout_pb2.WeightUpdateChunk.FromString(serialize(tampered))
    assert parsed.bucket.checksum == honest.bucket.checksum ^ 0xFF


def test_encoding_without_the_native_copy_gives_the_same_bytes(monkeypatch):
    from services.common import checksum

    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(5000, generator=gen), "b": torch.randn(3, 5, generator=gen).to(torch.bfloat16)}
    native = serialize(_chunk(tensors))
    monkeypatch.setattr(checksum, "_wordcopy", None)
    assert serialize(_chunk(tensors)) == native

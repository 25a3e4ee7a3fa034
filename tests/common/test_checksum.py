"""Checksums: the stepped (cache-blocked) word sums and the native kernels (`_wordcopy.c`) equal the one-pass sums
of the same bytes, whatever the size and alignment; the checksum is the one common.proto specifies and sees words
or chunks moved inside a tensor; the finiteness test flags every inf and NaN."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from services.common import checksum
from services.common.checksum import (
    CHUNK_BYTES,
    bucket_checksum,
    chain_sums,
    copy_word_sum,
    copy_word_sum_and_finite,
    data_checksum,
    fold,
    tensor_word_sum,
    word_sum,
    word_sum_and_finite,
)
from services.rollout.weight_checks import _checksum_and_finite

# The native kernel streams its stores from 256 KiB on (STREAM_BYTES in _wordcopy.c): sizes on both sides.
STREAM_BYTES = 256 << 10
SIZES = [0, 1, 7, 8, 9, 31, 33, STREAM_BYTES - 1, STREAM_BYTES + 5, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 3,
         2 * CHUNK_BYTES + 13]
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(params=["native", "torch"], autouse=True)
def kernels(request, monkeypatch) -> str:
    """Every test runs on both paths: the C kernels and the torch path a build without a compiler takes."""
    if request.param == "torch":
        monkeypatch.setattr(checksum, "_wordcopy", None)
    return request.param


def test_native_kernels_are_built(kernels: str) -> None:
    assert checksum.NATIVE, ("services/common/_wordcopy.c was not built (no C compiler at install?): make setup "
                             "builds it with the editable install")


def _reference_sum(data: bytes) -> tuple[int, int]:
    """The definition, independently (numpy's wrapping u64 arithmetic): little-endian u64 words w_0..w_{N-1},
    the tail zero-padded; s1 = sum of w_i, s2 = sum of (N - i) * w_i."""
    padded = data + b"\0" * (-len(data) % 8)
    if not padded:
        return 0, 0
    words = np.frombuffer(padded, dtype="<u8")
    weights = np.arange(len(words), 0, -1, dtype=np.uint64)
    return int(words.sum(dtype=np.uint64)), int((words * weights).sum(dtype=np.uint64))


def _spec_checksum(data: bytes) -> int:
    """WeightBucket.checksum's text in protos/rlfabric/v1/common.proto, word by word, as another client would."""
    s1 = s2 = 0
    for at in range(0, len(data), 8):
        w = int.from_bytes(data[at:at + 8].ljust(8, b"\0"), "little")
        s1 = (s1 + w) % 2**64
        s2 = (s2 + s1) % 2**64
    return zlib.crc32(s1.to_bytes(8, "little") + s2.to_bytes(8, "little") + len(data).to_bytes(8, "little"))


def test_the_checksum_is_the_one_the_proto_specifies() -> None:
    tensors = [_random_bytes(n, seed=n) for n in (0, 1, 7, 8, 13, 64, 1001)]
    for data in tensors:
        assert data_checksum(data) == _spec_checksum(data)
    # A bucket chains its tensors' checksums: CRC-32 of each as 4 little-endian bytes, in order.
    from rlfabric.v1 import common_pb2

    named = [common_pb2.NamedTensor(name=str(i), tensor=common_pb2.Tensor(data=d)) for i, d in enumerate(tensors)]
    assert bucket_checksum(named) == zlib.crc32(b"".join(struct.pack("<I", _spec_checksum(d)) for d in tensors))
    # Pinned, so the definition cannot drift with the code that computes it (bytes 0..19).
    assert data_checksum(bytes(range(20))) == _spec_checksum(bytes(range(20))) == 0x640B5736


def test_chained_runs_equal_the_sums_of_the_whole() -> None:
    data = _random_bytes(8 * 1000 + 3)
    for cut in (0, 8, 8 * 999, 8 * 1000):
        head, tail = _reference_sum(data[:cut]), _reference_sum(data[cut:])
        assert chain_sums(head, tail, -(-(len(data) - cut) // 8)) == _reference_sum(data)


@pytest.mark.parametrize("n", [24, 4096 + 5, STREAM_BYTES + 77, 2 * CHUNK_BYTES + 13])
def test_swapped_words_or_chunks_change_the_checksum(n: int) -> None:
    """Every byte still there, in the wrong place: a plain sum of the words cannot tell, these sums do."""
    data = _random_bytes(n, seed=n)
    last = (n // 8 - 1) * 8  # the last whole word
    words = bytearray(data)
    words[0:8], words[last:last + 8] = data[last:last + 8], data[0:8]
    half = n // 2 // 8 * 8
    chunks = data[half:2 * half] + data[:half] + data[2 * half:]
    for moved in (bytes(words), chunks):
        assert moved != data and sorted(moved) == sorted(data)
        assert _reference_sum(moved)[0] == _reference_sum(data)[0]  # what the first sum alone sees: nothing
        assert data_checksum(moved) != data_checksum(data)
        t = torch.frombuffer(bytearray(moved), dtype=torch.uint8)
        assert fold(copy_word_sum(torch.zeros(n, dtype=torch.uint8), t), n) == data_checksum(moved)


def _random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("n", SIZES)
def test_copy_word_sum_copies_the_bytes_and_equals_the_one_pass_sum(n: int) -> None:
    data = _random_bytes(n)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    assert copy_word_sum(dst, src) == _reference_sum(data)
    assert dst.numpy().tobytes() == data
    assert word_sum(data) == _reference_sum(data)


def test_a_changed_byte_in_the_last_step_changes_the_stepped_sum() -> None:
    data = bytearray(_random_bytes(2 * CHUNK_BYTES + 13))
    before = copy_word_sum(torch.zeros(len(data), dtype=torch.uint8), torch.frombuffer(data, dtype=torch.uint8))
    data[-1] ^= 1
    after = copy_word_sum(torch.zeros(len(data), dtype=torch.uint8), torch.frombuffer(data, dtype=torch.uint8))
    assert before != after
    assert after == _reference_sum(bytes(data))


@pytest.mark.parametrize("dst_offset", [0, 3, 4, 8])  # unaligned, word-aligned but not 16-byte aligned, ...
@pytest.mark.parametrize("src_offset", [0, 5])
def test_copy_word_sum_at_any_alignment(dst_offset: int, src_offset: int) -> None:
    n = STREAM_BYTES + 77
    data = _random_bytes(n + src_offset, seed=dst_offset)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)[src_offset:]
    backing = torch.zeros(n + dst_offset + 16, dtype=torch.uint8)
    dst = backing[dst_offset:dst_offset + n]
    assert copy_word_sum(dst, src) == _reference_sum(data[src_offset:])
    assert dst.numpy().tobytes() == data[src_offset:]
    assert not backing[:dst_offset].any() and not backing[dst_offset + n:].any()  # nothing written around it


def test_copy_word_sum_refuses_buffers_of_different_sizes() -> None:
    with pytest.raises(ValueError, match="cannot copy 9 bytes into 8"):
        copy_word_sum(torch.zeros(8, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8))


def test_a_tensor_at_an_unaligned_offset_sums_like_its_bytes() -> None:
    x = torch.arange(2 * CHUNK_BYTES // 4 + 5, dtype=torch.float32)[1:]  # storage offset of 4 bytes
    raw = x.view(torch.uint8)
    assert tensor_word_sum(raw) == _reference_sum(x.numpy().tobytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_the_replicas_stepped_checks_equal_the_senders_checksum(dtype: torch.dtype, extra: int) -> None:
    numel = 2 * CHUNK_BYTES // torch.empty(0, dtype=dtype).element_size() + extra
    t = torch.randn(numel, generator=torch.Generator().manual_seed(extra)).to(dtype).reshape(-1, 1)
    checksum, finite = _checksum_and_finite(t)
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert checksum == data_checksum(raw) == fold(_reference_sum(raw), len(raw))
    assert finite


@pytest.mark.parametrize("where", [0, CHUNK_BYTES // 4, -1])  # the first step, the second's first value, the last
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_in_any_step_is_flagged(where: int, bad: float) -> None:
    t = torch.ones(2 * CHUNK_BYTES // 4 + 3)
    t[where] = bad
    checksum, finite = _checksum_and_finite(t)
    assert not finite
    assert checksum == data_checksum(t.numpy().tobytes())  # the steps after a bad one are still summed


def _non_finite_at(dtype: torch.dtype, numel: int, where: int, bad: float) -> torch.Tensor:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    t[where] = bad
    return t


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("where", [0, 1, 4097, -2, -1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_every_float_layout_flags_inf_and_nan_anywhere(dtype: torch.dtype, where: int, bad: float) -> None:
    numel = STREAM_BYTES // torch.empty(0, dtype=dtype).element_size() + 3  # odd: a partial last word
    t = _non_finite_at(dtype, numel, where, bad)
    raw = t.view(torch.uint8).numpy().tobytes()
    total, finite = word_sum_and_finite(t)
    assert (total, finite) == (_reference_sum(raw), False)
    dst = torch.zeros_like(t)
    total, finite = copy_word_sum_and_finite(dst, t)
    assert (total, finite) == (_reference_sum(raw), False)
    assert dst.view(torch.uint8).numpy().tobytes() == raw


@pytest.mark.parametrize("dtype", FLOATS)
def test_extreme_finite_values_are_finite_to_the_native_kernel(dtype: torch.dtype, kernels: str) -> None:
    info = torch.finfo(dtype)
    values = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0, info.eps], dtype=dtype)
    t = values.repeat(STREAM_BYTES // values.nbytes + 1)
    total, finite = copy_word_sum_and_finite(torch.empty_like(t), t)
    assert total == _reference_sum(t.view(torch.uint8).numpy().tobytes())
    # The torch path's float sum overflows on such values ("maybe not finite": the caller checks exactly).
    assert finite or kernels == "torch"


def test_copy_word_sum_and_finite_refuses_other_dtypes_or_sizes() -> None:
    with pytest.raises(ValueError, match="cannot copy"):
        copy_word_sum_and_finite(torch.zeros(4, dtype=torch.float16), torch.zeros(4))
    with pytest.raises(ValueError, match="cannot copy"):
        copy_word_sum_and_finite(torch.zeros(4), torch.zeros(5))

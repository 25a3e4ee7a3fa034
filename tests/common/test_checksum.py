"""Checksums: the stepped (cache-blocked) word sums and the native kernels (`_wordcopy.c`) equal the one-pass sum
of the same bytes, whatever the size and alignment; the finiteness test flags every inf and NaN."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common import checksum
from services.common.checksum import (
    CHUNK_BYTES,
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


def _reference_sum(data: bytes) -> int:
    """The definition, independently: little-endian u64 words, the tail zero-padded, wrapping sum."""
    padded = data + b"\0" * (-len(data) % 8)
    return int(np.frombuffer(padded, dtype="<u8").sum(dtype=np.uint64)) if padded else 0


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

"""Checksums: the stepped (cache-blocked) word sums equal the one-pass sum of the same bytes, whatever the size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.checksum import (
    CHUNK_BYTES,
    copy_word_sum,
    data_checksum,
    fold,
    tensor_word_sum,
    word_sum,
)
from services.rollout.weight_checks import _checksum_and_finite

SIZES = [0, 1, 7, 8, 9, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 3, 2 * CHUNK_BYTES + 13]


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

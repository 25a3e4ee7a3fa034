"""decode(encode(x)) == x for every wire dtype and shape, and malformed tensors are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlfabric.v1 import common_pb2
from services.common import checksum, tensors

NUMPY_DTYPES = ["float32", "float16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"]


@settings(max_examples=60, deadline=None)
@given(
    arr=st.sampled_from(NUMPY_DTYPES).flatmap(
        lambda dt: hnp.arrays(dtype=np.dtype(dt), shape=hnp.array_shapes(min_dims=0, max_dims=4, max_side=5))
    )
)
def test_numpy_round_trip(arr: np.ndarray) -> None:
    msg = tensors.to_proto(arr)
    back = tensors.to_numpy(common_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.shape == arr.shape
    assert back.dtype == arr.dtype.newbyteorder("<") or back.dtype == arr.dtype
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool])
def test_torch_round_trip(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, generator=g) * 100).to(dtype)
    back = tensors.to_torch(tensors.to_proto(x))
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back, x)


def test_non_contiguous_torch_is_packed_in_logical_order() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(tensors.to_torch(tensors.to_proto(x)), x)


def test_wire_layout_is_little_endian_row_major() -> None:
    msg = tensors.to_proto(np.array([[1, 2], [3, 256]], dtype=np.int32))
    assert msg.data == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0])
    assert list(msg.shape) == [2, 2] and msg.dtype == common_pb2.DTYPE_INT32


def test_to_numpy_is_zero_copy_read_only() -> None:
    back = tensors.to_numpy(tensors.to_proto(np.ones(4, dtype=np.float32)))
    assert not back.flags.writeable


@pytest.mark.parametrize(
    "msg, needle",
    [
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[3], data=b"\0" * 8), "needs 12 bytes, got 8"),
        (common_pb2.Tensor(shape=[1], data=b"\0" * 4), "not set"),
        (common_pb2.Tensor(dtype=common_pb2.DTYPE_INT32, shape=[-1], data=b""), "negative"),
    ],
)
def test_malformed_tensors_are_refused(msg: common_pb2.Tensor, needle: str) -> None:
    with pytest.raises(tensors.TensorDecodeError, match=needle):
        tensors.to_numpy(msg)


def test_bucket_checksum_depends_on_bytes_and_order() -> None:
    a = common_pb2.NamedTensor(name="a", tensor=tensors.to_proto(np.arange(4, dtype=np.float32)))
    b = common_pb2.NamedTensor(name="b", tensor=tensors.to_proto(np.arange(4, 8, dtype=np.float32)))
    assert checksum.bucket_checksum([a, b]) != checksum.bucket_checksum([b, a])
    c = common_pb2.NamedTensor()
    c.CopyFrom(b)
    c.tensor.data = b.tensor.data[:-1] + b"\x01"
    assert checksum.bucket_checksum([a, b]) != checksum.bucket_checksum([a, c])
    assert checksum.combine_checksums([1, 2]) != checksum.combine_checksums([2, 1])

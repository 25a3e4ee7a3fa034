"""Packed tensors on the wire: numpy/torch arrays <-> `rlfabric.v1.Tensor`.

The wire format is little-endian, row-major, unpadded bytes plus dtype and shape, so decoding is a
zero-copy `np.frombuffer` over the message bytes. torch is imported lazily so that services which only
move bytes (and the CLI) stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rlfabric.v1 import common_pb2

if TYPE_CHECKING:
    import torch

# bfloat16 has no numpy dtype: it travels as its raw 16-bit pattern and is viewed as uint16 in numpy.
_NUMPY_DTYPES: dict[int, np.dtype] = {
    common_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    common_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    common_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),
    common_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    common_pb2.DTYPE_INT8: np.dtype("i1"),
    common_pb2.DTYPE_UINT8: np.dtype("u1"),
    common_pb2.DTYPE_INT16: np.dtype("<i2"),
    common_pb2.DTYPE_INT32: np.dtype("<i4"),
    common_pb2.DTYPE_INT64: np.dtype("<i8"),
    common_pb2.DTYPE_BOOL: np.dtype("?"),
}
_FROM_NUMPY: dict[str, int] = {
    "float32": common_pb2.DTYPE_FLOAT32,
    "float16": common_pb2.DTYPE_FLOAT16,
    "float64": common_pb2.DTYPE_FLOAT64,
    "int8": common_pb2.DTYPE_INT8,
    "uint8": common_pb2.DTYPE_UINT8,
    "int16": common_pb2.DTYPE_INT16,
    "int32": common_pb2.DTYPE_INT32,
    "int64": common_pb2.DTYPE_INT64,
    "bool": common_pb2.DTYPE_BOOL,
}
_TORCH_NAMES: dict[int, str] = {
    common_pb2.DTYPE_FLOAT32: "float32",
    common_pb2.DTYPE_FLOAT16: "float16",
    common_pb2.DTYPE_BFLOAT16: "bfloat16",
    common_pb2.DTYPE_FLOAT64: "float64",
    common_pb2.DTYPE_INT8: "int8",
    common_pb2.DTYPE_UINT8: "uint8",
    common_pb2.DTYPE_INT16: "int16",
    common_pb2.DTYPE_INT32: "int32",
    common_pb2.DTYPE_INT64: "int64",
    common_pb2.DTYPE_BOOL: "bool",
}
_CODES: dict[str, int] = {name: code for code, name in _TORCH_NAMES.items()}


class TensorDecodeError(ValueError):
    """A `Tensor` message whose dtype, shape and byte length do not agree."""


def itemsize(dtype: int) -> int:
    return _NUMPY_DTYPES[dtype].itemsize


def dtype_code(dtype: Any) -> int:
    """The `DType` value of a torch dtype or its name ("float32", "torch.bfloat16", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _CODES:
        raise ValueError(f"dtype {name!r} has no wire type (supported: {sorted(_CODES)})")
    return _CODES[name]


def dtype_name(code: int) -> str:
    """The torch dtype name ("float32", "bfloat16", ...) of a `DType` value."""
    if code not in _TORCH_NAMES:
        raise ValueError(f"dtype {code} is not set or unknown (known: "
                         f"{[common_pb2.DType.Name(c) for c in _TORCH_NAMES]})")
    return _TORCH_NAMES[code]


def to_proto(x: Any) -> common_pb2.Tensor:
    """Pack a numpy array or torch tensor (any device) into a `Tensor` message."""
    if _is_torch(x):
        return _torch_to_proto(x)
    arr = np.asarray(x)
    code = _FROM_NUMPY.get(arr.dtype.name)
    if code is None:
        raise TypeError(f"unsupported dtype {arr.dtype} for the wire (supported: {sorted(_FROM_NUMPY)})")
    arr = np.require(arr, dtype=_NUMPY_DTYPES[code], requirements="C")
    return common_pb2.Tensor(dtype=code, shape=list(arr.shape), data=arr.tobytes())


def to_numpy(t: common_pb2.Tensor) -> np.ndarray:
    """A read-only numpy view over the message bytes (bfloat16 comes back as its uint16 bit pattern)."""
    if t.dtype not in _NUMPY_DTYPES:
        raise TensorDecodeError(f"tensor dtype {t.dtype} is not set or unknown")
    dtype = _NUMPY_DTYPES[t.dtype]
    shape = tuple(int(d) for d in t.shape)
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"tensor shape {shape} has a negative dimension")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(t.data) != count * dtype.itemsize:
        raise TensorDecodeError(
            f"tensor of shape {shape} and dtype {common_pb2.DType.Name(t.dtype)} needs "
            f"{count * dtype.itemsize} bytes, got {len(t.data)}"
        )
    return np.frombuffer(t.data, dtype=dtype, count=count).reshape(shape)


def to_torch(t: common_pb2.Tensor) -> torch.Tensor:
    """A CPU torch tensor over the message bytes (no copy; do not write to it)."""
    import torch

    arr = to_numpy(t)
    if t.dtype == common_pb2.DTYPE_BFLOAT16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    import warnings

    with warnings.catch_warnings():
        # frombuffer over immutable bytes warns that the tensor is not writable; that is the contract here.
        warnings.simplefilter("ignore", UserWarning)
        if arr.size == 0:
            return torch.empty(arr.shape, dtype=getattr(torch, _TORCH_NAMES[t.dtype]))
        return torch.frombuffer(t.data, dtype=getattr(torch, _TORCH_NAMES[t.dtype])).reshape(arr.shape)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _torch_to_proto(x: torch.Tensor) -> common_pb2.Tensor:
    import torch

    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    x = x.contiguous()
    code = _CODES.get(str(x.dtype).removeprefix("torch."))
    if code is None:
        raise TypeError(f"unsupported torch dtype {x.dtype} for the wire")
    raw = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    return common_pb2.Tensor(dtype=code, shape=list(x.shape), data=raw.numpy().tobytes())

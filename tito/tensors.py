"""Tensor codec: numpy/torch arrays <-> `tito.v1.Tensor` (raw little-endian bytes, dtype, shape).

Never pickle, never base64 inside JSON. bfloat16 has no numpy dtype, so it is carried as its raw
16-bit pattern and converted through torch when torch is given one.
"""

from __future__ import annotations

import math

import numpy as np

from tito.errors import InvalidArgument
from tito.v1 import tensor_pb2

Dtype = tensor_pb2.Dtype

_NUMPY_BY_DTYPE: dict[int, np.dtype] = {
    Dtype.DTYPE_FLOAT32: np.dtype("<f4"),
    Dtype.DTYPE_FLOAT16: np.dtype("<f2"),
    Dtype.DTYPE_BFLOAT16: np.dtype("<u2"),  # raw bits; see module docstring
    Dtype.DTYPE_FLOAT64: np.dtype("<f8"),
    Dtype.DTYPE_INT64: np.dtype("<i8"),
    Dtype.DTYPE_INT32: np.dtype("<i4"),
    Dtype.DTYPE_INT16: np.dtype("<i2"),
    Dtype.DTYPE_INT8: np.dtype("i1"),
    Dtype.DTYPE_UINT8: np.dtype("u1"),
    Dtype.DTYPE_BOOL: np.dtype("?"),
}
#: The most dimensions a tensor may have: numpy's own limit (an array cannot have more), far
#: above any model input's (pixel values have 2 to 5).
MAX_DIMS = 64

_DTYPE_BY_NUMPY = {v.str: k for k, v in _NUMPY_BY_DTYPE.items() if k != Dtype.DTYPE_BFLOAT16}
_DTYPE_BY_TORCH_NAME = {
    "float32": Dtype.DTYPE_FLOAT32, "float16": Dtype.DTYPE_FLOAT16, "bfloat16": Dtype.DTYPE_BFLOAT16,
    "float64": Dtype.DTYPE_FLOAT64, "int64": Dtype.DTYPE_INT64, "int32": Dtype.DTYPE_INT32,
    "int16": Dtype.DTYPE_INT16, "int8": Dtype.DTYPE_INT8, "uint8": Dtype.DTYPE_UINT8, "bool": Dtype.DTYPE_BOOL,
}


def itemsize(dtype: int) -> int:
    return _NUMPY_BY_DTYPE[dtype].itemsize


def dtype_number(dtype: np.dtype) -> int:
    """The `tito.v1.Dtype` number of a numpy dtype of either byte order (TypeError: unsupported)."""
    little = dtype if dtype.itemsize == 1 else dtype.newbyteorder("<")
    if little.str not in _DTYPE_BY_NUMPY:
        raise TypeError(f"unsupported tensor dtype {little}")
    return _DTYPE_BY_NUMPY[little.str]


def from_numpy(array: np.ndarray) -> tensor_pb2.Tensor:
    array = np.asarray(array)
    dtype = dtype_number(array.dtype)
    little = array.dtype if array.dtype.itemsize == 1 else array.dtype.newbyteorder("<")
    array = np.asarray(array, dtype=little, order="C")  # keeps 0-d scalars 0-d
    return tensor_pb2.Tensor(dtype=dtype, shape=list(array.shape), data=array.tobytes())


def from_torch(tensor) -> tensor_pb2.Tensor:
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPE_BY_TORCH_NAME:
        raise TypeError(f"unsupported tensor dtype {tensor.dtype}")
    t = tensor.detach().to("cpu").contiguous()
    raw = t.view(torch.int16) if name == "bfloat16" else t
    return tensor_pb2.Tensor(dtype=_DTYPE_BY_TORCH_NAME[name], shape=list(t.shape), data=raw.numpy().tobytes())


def check(tensor: tensor_pb2.Tensor, field: str) -> None:
    """Validate dtype, shape and byte length; raise InvalidArgument naming `field`."""
    if tensor.dtype not in _NUMPY_BY_DTYPE:
        raise InvalidArgument(f"{field}.dtype: unknown or unspecified dtype {tensor.dtype}",
                              reason="TENSOR_DTYPE_INVALID", field=f"{field}.dtype")
    if len(tensor.shape) > MAX_DIMS:
        raise InvalidArgument(f"{field}.shape: at most {MAX_DIMS} dimensions, got {len(tensor.shape)}",
                              reason="TENSOR_SHAPE_INVALID", field=f"{field}.shape")
    if any(d < 0 for d in tensor.shape):
        raise InvalidArgument(f"{field}.shape: dimensions must be >= 0, got {list(tensor.shape)}",
                              reason="TENSOR_SHAPE_INVALID", field=f"{field}.shape")
    expected = math.prod(tensor.shape) * itemsize(tensor.dtype)
    if len(tensor.data) != expected:
        raise InvalidArgument(
            f"{field}.data: {len(tensor.data)} bytes, but shape {list(tensor.shape)} of "
            f"{Dtype.Name(tensor.dtype)} needs {expected}", reason="TENSOR_SIZE_MISMATCH", field=f"{field}.data")


def to_numpy(tensor: tensor_pb2.Tensor, field: str = "tensor") -> np.ndarray:
    """Decode without copying (read-only view over the message bytes). bfloat16 comes back as uint16 bits."""
    check(tensor, field)
    return np.frombuffer(tensor.data, dtype=_NUMPY_BY_DTYPE[tensor.dtype]).reshape(tuple(tensor.shape))


def to_torch(tensor: tensor_pb2.Tensor, field: str = "tensor"):
    import torch

    array = to_numpy(tensor, field)
    if tensor.dtype == Dtype.DTYPE_BFLOAT16:
        return torch.from_numpy(array.astype(np.int16, copy=True)).view(torch.bfloat16)
    return torch.from_numpy(array.copy())

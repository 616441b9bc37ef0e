"""ONNX attribute and tensor values -> plain Python / torch values for the op table."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

# ONNX TensorProto.DataType -> torch dtype, for every type our kernels handle.
ONNX_TO_TORCH: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.UINT16: torch.uint16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.UINT32: torch.uint32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.UINT64: torch.uint64,
    onnx.TensorProto.BOOL: torch.bool,
    onnx.TensorProto.COMPLEX64: torch.complex64,
    onnx.TensorProto.COMPLEX128: torch.complex128,
}
TORCH_TO_ONNX: dict[torch.dtype, int] = {v: k for k, v in ONNX_TO_TORCH.items()}


def torch_dtype(onnx_type: int, *, what: str = "value") -> torch.dtype:
    """The torch dtype of an ONNX element type; unsupported types name `what`."""
    try:
        return ONNX_TO_TORCH[onnx_type]
    except KeyError:
        name = (
            onnx.TensorProto.DataType.Name(onnx_type)
            if onnx_type in onnx.TensorProto.DataType.values()
            else onnx_type
        )
        raise NotImplementedError(f"{what}: ONNX element type {name} is not supported") from None


def tensor_value(t: onnx.TensorProto) -> torch.Tensor:
    """An ONNX TensorProto (data already loaded) as a torch tensor."""
    dtype = torch_dtype(t.data_type, what=f"tensor {t.name!r}")
    arr = numpy_helper.to_array(t)
    if dtype == torch.bfloat16:
        # numpy has no bfloat16: onnx gives a ml_dtypes array; go through its bits.
        bits = np.asarray(arr).view(np.uint16).astype(np.int32)
        return torch.from_numpy(bits).to(torch.int16).view(torch.bfloat16).reshape(arr.shape).clone()
    return torch.from_numpy(np.array(arr, copy=True)).to(dtype)


def attr_value(a: onnx.AttributeProto) -> Any:
    """An attribute's value: ints, floats, str, lists, or a torch tensor."""
    A = onnx.AttributeProto
    if a.type == A.INT:
        return int(a.i)
    if a.type == A.FLOAT:
        return float(a.f)
    if a.type == A.STRING:
        return a.s.decode("utf-8")
    if a.type == A.INTS:
        return [int(x) for x in a.ints]
    if a.type == A.FLOATS:
        return [float(x) for x in a.floats]
    if a.type == A.STRINGS:
        return [s.decode("utf-8") for s in a.strings]
    if a.type == A.TENSOR:
        return tensor_value(a.t)
    if a.type == A.TENSORS:
        return [tensor_value(t) for t in a.tensors]
    if a.type in (A.GRAPH, A.GRAPHS):
        raise NotImplementedError(f"attribute {a.name!r} holds a subgraph (control flow is not supported)")
    raise NotImplementedError(f"attribute {a.name!r} of ONNX attribute type {a.type} is not supported")

"""ONNX attribute and tensor values -> plain Python / torch values for the op table."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

# The dtype tables live in the IR (metaopt.ir.dtypes: ops and passes use them too); these names
# stay importable from here for older callers.
from metaopt.ir.dtypes import ONNX_TO_TORCH, TORCH_TO_ONNX
from metaopt.ir.dtypes import torch_dtype_from_onnx as torch_dtype

__all__ = ["ONNX_TO_TORCH", "TORCH_TO_ONNX", "attr_value", "tensor_value", "torch_dtype"]


def tensor_value(t: onnx.TensorProto) -> torch.Tensor:
    """An ONNX TensorProto (data already loaded) as a torch tensor."""
    dtype = torch_dtype(t.data_type, what=f"tensor {t.name!r}")
    arr = numpy_helper.to_array(t)
    if dtype == torch.bfloat16:
        # numpy has no bfloat16: onnx gives a ml_dtypes array; go through its bits.
        bits = np.asarray(arr).view(np.uint16).astype(np.int32)
        return torch.from_numpy(bits).to(torch.int16).view(torch.bfloat16).reshape(arr.shape).clone()
    return torch.from_numpy(np.array(arr, copy=True)).to(dtype)


def float32_literal(f: float) -> float:
    """The shortest decimal that rounds to float32 `f`, as a Python float.

    ONNX stores float attributes as float32, so a torch export's ``eps=1e-5`` arrives as
    9.99999975e-06; torch's kernels compute with the module's double (BatchNorm and LayerNorm add
    eps to the variance in double), and the rounded eps changes their float32 results by an ulp.
    The shortest decimal of the float32 is what the author wrote whenever they wrote a literal
    of up to ~7 digits (1e-5, 1e-12, 0.1, 1.702); any kernel computing in float32 rounds it back
    to the same float32."""
    return float(str(np.float32(f)))


def attr_value(a: onnx.AttributeProto) -> Any:
    """An attribute's value: ints, floats, str, lists, or a torch tensor."""
    A = onnx.AttributeProto
    if a.type == A.INT:
        return int(a.i)
    if a.type == A.FLOAT:
        return float32_literal(a.f)
    if a.type == A.STRING:
        return _text(a, a.s)
    if a.type == A.INTS:
        return [int(x) for x in a.ints]
    if a.type == A.FLOATS:
        return [float32_literal(x) for x in a.floats]
    if a.type == A.STRINGS:
        return [_text(a, s) for s in a.strings]
    if a.type == A.TENSOR:
        return tensor_value(a.t)
    if a.type == A.TENSORS:
        return [tensor_value(t) for t in a.tensors]
    if a.type in (A.GRAPH, A.GRAPHS):
        raise NotImplementedError(f"attribute {a.name!r} holds a subgraph (control flow is not supported)")
    raise NotImplementedError(f"attribute {a.name!r} of ONNX attribute type {a.type} is not supported")


def _text(a: onnx.AttributeProto, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"attribute {a.name!r} is not UTF-8 text: {raw[:20]!r}") from None

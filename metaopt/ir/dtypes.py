"""ONNX element types <-> torch dtypes: the one mapping the importer, the kernels and the passes share.

The keys are ONNX ``TensorProto.DataType`` values, fixed by the ONNX spec (written out here so
that the IR does not import onnx; tests/ir/test_dtypes.py checks them against the onnx package).
Only the types our kernels handle are listed; anything else is refused with an error naming it.
"""

from __future__ import annotations

import torch

# ONNX TensorProto.DataType -> torch dtype, for every type our kernels handle.
ONNX_TO_TORCH: dict[int, torch.dtype] = {
    1: torch.float32,  # FLOAT
    11: torch.float64,  # DOUBLE
    10: torch.float16,  # FLOAT16
    16: torch.bfloat16,  # BFLOAT16
    3: torch.int8,  # INT8
    2: torch.uint8,  # UINT8
    5: torch.int16,  # INT16
    4: torch.uint16,  # UINT16
    6: torch.int32,  # INT32
    12: torch.uint32,  # UINT32
    7: torch.int64,  # INT64
    13: torch.uint64,  # UINT64
    9: torch.bool,  # BOOL
    14: torch.complex64,  # COMPLEX64
    15: torch.complex128,  # COMPLEX128
}
TORCH_TO_ONNX: dict[torch.dtype, int] = {v: k for k, v in ONNX_TO_TORCH.items()}


def torch_dtype_from_onnx(onnx_type: int, *, what: str = "value") -> torch.dtype:
    """The torch dtype of an ONNX element type; unsupported types name `what`."""
    try:
        return ONNX_TO_TORCH[onnx_type]
    except KeyError:
        import onnx  # only to name the type in the error

        name = (
            onnx.TensorProto.DataType.Name(onnx_type)
            if onnx_type in onnx.TensorProto.DataType.values()
            else onnx_type
        )
        raise NotImplementedError(f"{what}: ONNX element type {name} is not supported") from None

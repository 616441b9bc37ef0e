"""The ONNX <-> torch dtype tables live in the IR (metaopt.ir.dtypes)."""

from __future__ import annotations

import onnx
import pytest
import torch

from metaopt.frontend import attrs
from metaopt.ir import ONNX_TO_TORCH, TORCH_TO_ONNX, dtype_name, torch_dtype_from_onnx


def test_keys_are_onnx_element_types():
    for code, dtype in ONNX_TO_TORCH.items():
        name = onnx.TensorProto.DataType.Name(code)
        want = {"FLOAT": "float32", "DOUBLE": "float64"}.get(name, name.lower())
        assert dtype_name(dtype) == want, (code, name, dtype)
    assert TORCH_TO_ONNX[torch.float16] == onnx.TensorProto.FLOAT16
    assert {v: k for k, v in TORCH_TO_ONNX.items()} == ONNX_TO_TORCH


def test_unsupported_types_are_named():
    assert torch_dtype_from_onnx(onnx.TensorProto.BFLOAT16) is torch.bfloat16
    with pytest.raises(NotImplementedError, match="Cast: ONNX element type STRING is not supported"):
        torch_dtype_from_onnx(onnx.TensorProto.STRING, what="Cast")
    with pytest.raises(NotImplementedError, match="ONNX element type 999 is not supported"):
        torch_dtype_from_onnx(999)


def test_frontend_names_are_the_same_tables():
    assert attrs.ONNX_TO_TORCH is ONNX_TO_TORCH and attrs.TORCH_TO_ONNX is TORCH_TO_ONNX
    assert attrs.torch_dtype is torch_dtype_from_onnx

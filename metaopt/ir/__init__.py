"""metaopt's IR. Imports nothing else of metaopt (DESIGN.md, Layout)."""

from metaopt.ir import names, roles
from metaopt.ir.dtypes import ONNX_TO_TORCH, TORCH_TO_ONNX, torch_dtype_from_onnx
from metaopt.ir.parser import ParseError, parse_program
from metaopt.ir.printer import print_program
from metaopt.ir.program import (
    GradientMergeInfo,
    Op,
    PipelineInfo,
    Program,
    Split,
    Var,
    ZeroShard,
    did_you_mean,
    dtype_name,
    eval_dim,
    torch_dtype,
)
from metaopt.ir.verify import VerifyError, verify

__all__ = [
    "ONNX_TO_TORCH",
    "TORCH_TO_ONNX",
    "Op",
    "ParseError",
    "GradientMergeInfo",
    "PipelineInfo",
    "Program",
    "Split",
    "Var",
    "VerifyError",
    "ZeroShard",
    "did_you_mean",
    "dtype_name",
    "eval_dim",
    "names",
    "parse_program",
    "print_program",
    "roles",
    "torch_dtype",
    "torch_dtype_from_onnx",
    "verify",
]

"""metaopt's IR. Imports nothing else of metaopt (DESIGN.md, Layout)."""

from metaopt.ir import names
from metaopt.ir.parser import ParseError, parse_program
from metaopt.ir.printer import print_program
from metaopt.ir.program import (
    Op,
    PipelineInfo,
    Program,
    Var,
    did_you_mean,
    dtype_name,
    eval_dim,
    torch_dtype,
)
from metaopt.ir.verify import VerifyError, verify

__all__ = [
    "Op",
    "ParseError",
    "PipelineInfo",
    "Program",
    "Var",
    "VerifyError",
    "did_you_mean",
    "dtype_name",
    "eval_dim",
    "names",
    "parse_program",
    "print_program",
    "torch_dtype",
    "verify",
]

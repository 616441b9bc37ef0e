"""metaopt: a static-graph program-rewrite optimizer for training (Fleet-style), on torch + ONNX."""

from __future__ import annotations

import torch

from metaopt import fleet, optimizer
from metaopt.frontend.importer import load
from metaopt.frontend.torch_export import export
from metaopt.ir import Op, Program, Var, verify
from metaopt.report import memory_picture
from metaopt.runtime import CPUPlace, CUDAPlace, Executor

__version__ = "0.1.0"


def seed(n: int) -> None:
    """Fix every random op's mask: same as torch.manual_seed(n) (all devices)."""
    torch.manual_seed(n)


__all__ = [
    "CPUPlace",
    "CUDAPlace",
    "Executor",
    "Op",
    "Program",
    "Var",
    "export",
    "fleet",
    "load",
    "memory_picture",
    "optimizer",
    "seed",
    "verify",
]

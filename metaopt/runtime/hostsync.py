"""Proof on the CPU that a step reads no device value on the host: ``Executor("meta")``.

On a GPU a host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``)
waits for everything queued before it and cannot be captured in a CUDA graph. On the meta
device tensors have shapes and dtypes but no values, so such a read cannot happen unnoticed:
the executor runs every kernel of a meta plan under `HostReadGuard`, which turns it into a
`HostSyncError` naming the op, its printed line and the var whose value was read.

Host values proper (shape arithmetic the plan computes on the CPU, constants' host mirrors:
ops/placement.py's ``host_placement``) are real CPU tensors on meta too, and reading them is
free on any device, so only reads of meta tensors are refused.

Some of torch's in-place multi-tensor kernels (the fused optimizers, the foreach unscale of AMP)
have no meta implementation; they only write their inputs in place, which on meta changes
nothing, so the guard checks their tensors are meta and returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from metaopt.ir import Op


class HostSyncError(RuntimeError):
    """A kernel read a device value on the host (a sync, and a step no CUDA graph can capture)."""


_aten = torch.ops.aten
# Reads that hand a tensor's value to Python.
_SCALAR_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default}  # `.to`, `.cpu()` and `.tolist()` arrive as these
# In-place kernels without a meta implementation: on meta they have nothing to write.
_IN_PLACE_ONLY = {
    name
    for name in (
        "_fused_adam_",
        "_fused_adamw_",
        "_fused_sgd_",
        "_amp_foreach_non_finite_check_and_unscale_",
    )
    if hasattr(_aten, name)
}


def _tensors(xs: Any) -> list[torch.Tensor]:
    out = []
    for x in xs if isinstance(xs, (list, tuple)) else [xs]:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out += _tensors(x)
    return out


class HostReadGuard(TorchDispatchMode):
    """Refuses host reads of meta tensors while `ops` run; `names` maps the id of each
    argument tensor to its var, to name what was read."""

    def __init__(self, ops: Sequence[Op], names: dict[int, str]) -> None:
        super().__init__()
        self.ops = ops
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCALAR_READS and any(t.device.type == "meta" for t in _tensors(args)):
            self._refuse(func, _tensors(args)[0])
        if func in _COPIES:
            src = args[1] if func is _aten.copy_.default else args[0]
            dst = args[0].device if func is _aten.copy_.default else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type == "meta" and dst is not None:
                if torch.device(dst).type != "meta":
                    self._refuse(func, src)
        if func.overloadpacket.__name__ in _IN_PLACE_ONLY:
            if all(t.device.type == "meta" for t in _tensors(args) + _tensors(list(kwargs.values()))):
                return None
        return func(*args, **kwargs)

    def _refuse(self, func, t: torch.Tensor) -> None:
        name = self._name(t)
        what = f"var {name!r}" if name else "a value the kernel computed from its inputs"
        op = self.ops[0]
        # the plan's error names the op and its printed line (Plan.op_error); a group is said here
        group = f" (one multi-tensor call of {len(self.ops)} {op.type} ops)" if len(self.ops) > 1 else ""
        raise HostSyncError(
            f"{op.type}{group} reads {what} on the host ({func.overloadpacket.__name__}): on a GPU "
            "this waits for the device and cannot be captured in a CUDA graph"
        )

    def _name(self, t: torch.Tensor) -> str | None:
        while t is not None:
            name = self.names.get(id(t))
            if name is not None:
                return name
            t = t._base
        return None


def guarded(kernel: Callable, ops: Sequence[Op]) -> Callable:
    """`kernel` (running `ops`: one op, or a multi-tensor group whose arguments are the ops'
    inputs in turn) under a `HostReadGuard`."""
    inputs = [x for op in ops for x in op.inputs]

    def run(*args):
        names = {id(a): x for a, x in zip(args, inputs, strict=False) if isinstance(a, torch.Tensor) and x}
        with HostReadGuard(ops, names):
            return kernel(*args)

    return run

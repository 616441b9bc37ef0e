"""Fold what is static once, at import: the exporter's Shape/Gather/Concat chains.

* An op whose inputs are all constants is evaluated with its kernel and its
  outputs become constants (unless an output is large: folding must not turn a
  cheap Expand into megabytes of program data).
* ``Shape``/``Size`` of a var whose (selected) dims are all static is a constant.
* A ``Reshape`` whose target is computed at run time but whose output shape has
  exactly one symbolic dim gets a constant target with ``-1`` there; an
  ``Expand`` whose symbolic output dims come from the input gets ``1`` there.
  The chain that computed the target then dies (see `dead_code`).

Random ops are never folded.
"""

from __future__ import annotations

import torch

from metaopt.ir import Op, Program, Var, dtype_name, names
from metaopt.ops import registry

MAX_FOLDED_NUMEL = 1 << 12


def fold_constants(p: Program, *, max_numel: int = MAX_FOLDED_NUMEL) -> Program:
    q = p.clone()
    consts = {v.name: q.values[v.name] for v in q.vars.values() if v.kind == "constant"}
    ops: list[Op] = []
    for op in q.ops:
        folded = _fold(q, op, consts, max_numel)
        if folded is None:
            _static_target(q, op, consts)
            ops.append(op)
            continue
        for name, value in zip(op.outputs, folded, strict=False):
            if name:
                consts[name] = value
                q.vars[name] = Var(name, dtype_name(value.dtype), tuple(value.shape), kind="constant")
                q.values[name] = value
    q.ops = ops
    return q


def _fold(q: Program, op: Op, consts: dict[str, torch.Tensor], max_numel: int) -> list[torch.Tensor] | None:
    row = registry.get(op.type)
    if row is None or row.random or row.domain:
        return None
    if op.type in ("Shape", "Size"):
        return _fold_shape(q, op)
    if not all(x in consts for x in op.inputs if x):
        return None
    kw = dict(op.attrs)
    if row.needs_outputs:
        kw["_nout"] = len(op.outputs)
    if row.needs_device:
        kw["_device"] = torch.device("cpu")
    out = row.kernel(*[consts[x] if x else None for x in op.inputs], **kw)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if any(t is not None and t.numel() > max_numel for t in outs):
        return None
    return [t.clone() if t is not None else None for t in outs]


def _fold_shape(q: Program, op: Op) -> list[torch.Tensor] | None:
    shape = q.vars[op.inputs[0]].shape
    if shape is None:
        return None
    if op.type == "Size":
        if not all(isinstance(d, int) for d in shape):
            return None
        n = 1
        for d in shape:
            n *= d
        return [torch.tensor(n, dtype=torch.int64)]
    start, end = op.attrs.get("start", 0), op.attrs.get("end", len(shape))
    dims = list(shape)[slice(start, end)]
    if not all(isinstance(d, int) for d in dims):
        return None
    return [torch.tensor(dims, dtype=torch.int64)]


def _static_target(q: Program, op: Op, consts: dict[str, torch.Tensor]) -> None:
    """Give a Reshape/Expand a constant target when only the batch-like dim is symbolic."""
    if op.type not in ("Reshape", "Expand") or len(op.inputs) < 2 or op.inputs[1] in consts:
        return
    out = q.vars[op.outputs[0]].shape
    if out is None:
        return
    if op.type == "Reshape":
        sym = [i for i, d in enumerate(out) if isinstance(d, str)]
        if len(sym) != 1 or (op.attrs.get("allowzero", 0) and 0 in out):
            return
        target = [-1 if isinstance(d, str) else d for d in out]
        op.attrs["allowzero"] = 0
    else:
        src = q.vars[op.inputs[0]].shape
        if src is None:
            return
        aligned = [None] * (len(out) - len(src)) + list(src)
        target = []
        for d, s in zip(out, aligned, strict=True):
            if isinstance(d, str):
                if d != s:
                    return
                target.append(1)
            else:
                target.append(d)
    name = names.fresh("const", q.vars)
    value = torch.tensor(target, dtype=torch.int64)
    q.add_var(Var(name, "int64", (len(target),), kind="constant"), value)
    consts[name] = value
    op.inputs = [op.inputs[0], name, *op.inputs[2:]]

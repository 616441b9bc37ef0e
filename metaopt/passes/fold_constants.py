"""Fold what is static once, at import: the exporter's Shape/Gather/Concat chains.

* An op whose inputs are all constants is evaluated with its kernel and its
  outputs become constants (unless an output is large: folding must not turn a
  cheap Expand into megabytes of program data).
* Shape values: an op whose row has a ``shape_value`` rule (ops/registry.py) gives its
  output as a list of dims, ints or symbols. ``Shape``/``Size`` of a var whose (selected)
  dims are all static is a constant; a shape with symbolic dims is tracked as a list of
  dims through Gather, Slice, Concat, Squeeze and Unsqueeze (their rows' rules), so
  picking its static dims folds too.
* An op whose row has a ``static_target`` rule (``Reshape``, ``Expand``) and whose target
  is computed at run time gets the constant target the rule derives from the inferred
  output shape (Reshape: ``-1`` at its one symbolic dim; Expand: ``1`` where a symbolic
  output dim comes from the input). The chain that computed the target then dies (see
  `dead_code`).

* An all-zeros constant bias (a row's ``zero_bias_input``: bias-free convs come out
  of the exporter with one) is dropped.

Random ops are never folded.
"""

from __future__ import annotations

import torch

from metaopt.ir import Op, Program, Var, dtype_name, names, torch_dtype
from metaopt.ops import registry
from metaopt.ops.registry import ShapeArgs

MAX_FOLDED_NUMEL = 1 << 12


def fold_constants(p: Program, *, max_numel: int = MAX_FOLDED_NUMEL) -> Program:
    q = p.clone()
    consts = {v.name: q.values[v.name] for v in q.vars.values() if v.kind == "constant"}
    shapes: dict[str, tuple[list, bool]] = {}  # var -> (dims, is_scalar) of a shape value
    ops: list[Op] = []
    for op in q.ops:
        if op.role != "forward":  # a saved training program's backward stays as written
            ops.append(op)
            continue
        folded = _fold_shape_value(q, op, consts, shapes)
        if folded is None:
            folded = _fold(q, op, consts, max_numel)
        if folded is None:
            _static_target(q, op, consts)
            _drop_zero_bias(op, consts)
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
    args = []
    for i, x in enumerate(op.inputs):
        if not x:
            args.append(None)
        elif x in consts:
            args.append(consts[x])
        elif i in row.meta_inputs:
            args.append(torch.empty(0, dtype=torch_dtype(q.vars[x].dtype)))
        else:
            return None
    kw = dict(op.attrs)
    if row.needs_outputs:
        kw["_nout"] = len(op.outputs)
    if row.needs_device:
        kw["_device"] = torch.device("cpu")
    out = row.kernel(*args, **kw)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if any(t is not None and t.numel() > max_numel for t in outs):
        return None
    return [t.clone() if t is not None else None for t in outs]


def _fold_shape_value(
    q: Program, op: Op, consts: dict[str, torch.Tensor], shapes: dict[str, tuple[list, bool]]
) -> list[torch.Tensor] | None:
    """Track shape values with symbolic dims; fold once the selected dims are static."""
    row = registry.get(op.type)
    rule = row.shape_value if row is not None else None
    if rule is None:
        return None

    def dims_of(name: str) -> tuple[list, bool] | None:
        if name in shapes:
            return shapes[name]
        c = consts.get(name)
        if c is not None and c.dtype == torch.int64 and c.dim() <= 1:
            return c.reshape(-1).tolist(), c.dim() == 0
        return None

    args = ShapeArgs(
        attrs=op.attrs,
        values=[dims_of(x) if x else None for x in op.inputs],
        tracked=[shapes.get(x) if x else None for x in op.inputs],
        shapes=[q.vars[x].shape if x else None for x in op.inputs],
    )
    result = rule(args)
    if result is None:
        return None
    dims, scalar = result
    if all(isinstance(d, int) for d in dims):
        t = torch.tensor(dims[0] if scalar else dims, dtype=torch.int64)
        return [t]
    shapes[op.outputs[0]] = result
    return None


def _drop_zero_bias(op: Op, consts: dict[str, torch.Tensor]) -> None:
    row = registry.get(op.type)
    k = row.zero_bias_input if row is not None else None
    if k is not None and k < len(op.inputs) and op.inputs[k] in consts and not consts[op.inputs[k]].any():
        op.inputs = op.inputs[:k]


def _static_target(q: Program, op: Op, consts: dict[str, torch.Tensor]) -> None:
    """Give a Reshape/Expand (a row with a `static_target` rule) a constant target when only
    the batch-like dim is symbolic."""
    row = registry.get(op.type)
    rule = row.static_target if row is not None else None
    if rule is None or len(op.inputs) < 2 or op.inputs[1] in consts:
        return
    out = q.vars[op.outputs[0]].shape
    if out is None:
        return
    found = rule(op.attrs, out, q.vars[op.inputs[0]].shape)
    if found is None:
        return
    target, attrs = found
    op.attrs.update(attrs)
    name = names.fresh("const", q.vars)
    value = torch.tensor(target, dtype=torch.int64)
    q.add_var(Var(name, "int64", (len(target),), kind="constant"), value)
    consts[name] = value
    op.inputs = [op.inputs[0], name, *op.inputs[2:]]

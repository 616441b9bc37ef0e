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

Folding runs kernels on values the file chose, so no kernel runs unbounded: every torch op a
folding kernel calls is first run on the meta device (shapes only, nothing allocated) and
its output size checked. Over ``FOLD_SCRATCH_BYTES`` the op is simply not folded (it runs
at run time like any op); over ``metaopt.limits`` ``max_constant_bytes`` the load fails
with a `ConstantTooLarge` naming the op: a value computed from constants alone that large
is the file decompressing itself (a 150-byte ``ConstantOfShape([28000, 28000])``).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from metaopt import limits as _limits
from metaopt.ir import Op, Program, Var, dtype_name, names, torch_dtype
from metaopt.ops import registry
from metaopt.ops.registry import ShapeArgs

MAX_FOLDED_NUMEL = 1 << 12
# Bytes one torch op inside a folding kernel may allocate; a larger one means the folded
# value would be over MAX_FOLDED_NUMEL anyway (or the kernel is doing work we would rather
# do at run time), so the fold is abandoned before that allocation happens.
FOLD_SCRATCH_BYTES = 16 << 20


class ConstantTooLarge(ValueError):
    """A value computed at import from constants alone is over `LoadLimits.max_constant_bytes`."""


class _Abandon(Exception):
    """Raised inside a folding kernel: do not fold this op (carries the size that stopped it)."""

    def __init__(self, nbytes: int | None, what: str) -> None:
        super().__init__(what)
        self.nbytes, self.what = nbytes, what


# Torch ops with no meta kernel because their output size depends on the data. Each one's
# output is bounded by its inputs (which are already bounded), so they may run for real;
# any other op without a meta kernel abandons the fold.
_DATA_DEPENDENT_BOUNDED = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::equal",
        "aten::is_nonzero",
    }
)


def _to_meta(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


class _SizeGuard(TorchDispatchMode):
    """Run each torch op on meta first; refuse the real run if its output is too large."""

    def __init__(self, scratch: int, hard: int) -> None:
        super().__init__()
        self.scratch, self.hard = scratch, hard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        nbytes = self._output_bytes(func, args, kwargs)
        if nbytes is None:
            if func._schema.name not in _DATA_DEPENDENT_BOUNDED:
                raise _Abandon(None, f"{func} has no shape-only (meta) form")
        elif nbytes > self.scratch:
            raise _Abandon(nbytes, str(func))
        return func(*args, **kwargs)

    @staticmethod
    def _output_bytes(func, args, kwargs) -> int | None:  # noqa: ANN001
        meta_kwargs = dict(kwargs)
        if "device" in meta_kwargs:
            meta_kwargs["device"] = torch.device("meta")
        try:
            out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, meta_kwargs))
        except Exception:  # no meta kernel, or a data-dependent size: decided by the caller
            return None
        if func.is_view:
            return 0  # a view allocates nothing; what reads it is checked in turn
        aliased = [r.alias_info is not None for r in func._schema.returns]
        outs = out if isinstance(out, (tuple, list)) else [out]
        total = 0
        for i, t in enumerate(tree_flatten(outs)[0]):
            if isinstance(t, torch.Tensor) and not (i < len(aliased) and aliased[i]):
                total += t.numel() * t.element_size()
        return total


def fold_constants(p: Program, *, max_numel: int = MAX_FOLDED_NUMEL) -> Program:
    """Evaluate what is static (module doc). Raises ConstantTooLarge (naming the op) when a
    value computed from constants alone would be over the active load limits'
    ``max_constant_bytes``, before allocating it."""
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
    hard = _limits.active().max_constant_bytes
    pre = row.output_bytes  # kernels that allocate out of the meta device's sight
    try:
        nbytes = pre(op.attrs, args) if pre is not None else 0
        if nbytes is None:
            return None
        if nbytes > FOLD_SCRATCH_BYTES:
            raise _Abandon(nbytes, op.type)
        with _SizeGuard(min(FOLD_SCRATCH_BYTES, hard), hard):
            out = row.kernel(*args, **kw)
        # A view (Expand) allocated nothing yet, but the value it stands for is what the
        # program would hold: the limit is on that, whatever the kernel's trick.
        flat = out if isinstance(out, (tuple, list)) else [out]
        biggest = max((t.numel() * t.element_size() for t in flat if t is not None), default=0)
        if biggest > hard:
            raise _Abandon(biggest, "its output")
    except _Abandon as stop:
        if stop.nbytes is not None and stop.nbytes > hard:
            raise ConstantTooLarge(
                f"op {op.type} (outputs {op.outputs}{f', module {op.scope!r}' if op.scope else ''}) "
                f"computes a value from constants alone that needs {_limits.fmt_bytes(stop.nbytes)} "
                f"({stop.what}), over the limit of {_limits.fmt_bytes(hard)} for a constant "
                f"computed at load; {_limits.how_to_raise('max_constant_bytes')}"
            ) from None
        return None
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


def shape_values(p: Program) -> set[str]:
    """The int64 scalars and vectors no data flows into, whichever module's op computes them: made
    from shapes (an op whose row reads only its inputs' shapes: Shape, Size) and constants alone (a
    symbolic batch times a sequence). The exporter makes such a value once and later layers read
    it (DeepSeek-V3's tokens x top-k of its first MoE layer, read by the 57 after it)."""
    out: set[str] = set()
    for op in p.ops:
        row = registry.get(op.type)
        reads_shapes = row is not None and row.shape_value is not None and row.host_outputs
        free = reads_shapes or all(
            not x or x in out or (x in p.vars and p.vars[x].kind == "constant") for x in op.inputs
        )
        for o in op.outputs if free else ():
            v = p.vars.get(o) if o else None
            if v is not None and v.dtype == "int64" and v.shape is not None and len(v.shape) <= 1:
                out.add(o)
    return out


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

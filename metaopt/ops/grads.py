"""Gradient rules: one per op type, attached to that op's row in the op table.

A rule receives a `GradBuilder` (the protocol below; passes/backward.py implements it)
for one forward op and the names of its output grads (None where an output has none),
emits backward ops through the builder, and returns one grad name (or None) per op
input. Inputs the builder says need no grad (`g.needs(i)` false) may get None.

Ops without a rule here fall back to the generic `Vjp` rule (torch autograd on the
op's own kernel: exact, but it recomputes that op's forward in the backward); random
ops have no fallback: re-running them would draw a new mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from metaopt.ops import registry

if TYPE_CHECKING:
    from metaopt.ir import Op, Var


class GradBuilder(Protocol):
    """What a gradient rule uses of the backward pass's builder (passes/backward.py implements
    it: the ops layer does not import the passes)."""

    def needs(self, i: int) -> bool: ...  # does input i of the current op need a grad?
    def var(self, name: str) -> Var: ...
    def shape(self, name: str) -> tuple: ...
    def dtype(self, name: str) -> str: ...
    def onnx_dtype(self, name: str) -> int: ...
    def constant_value(self, name: str) -> Any: ...
    def contrib(self, x: str) -> str: ...
    def contribs(self, n: int | None = None) -> tuple[list[str], list[int]]: ...
    def const(self, value: Any, dtype: str) -> str: ...
    def temp(self, like: str, shape: tuple | None = None, dtype: str | None = None) -> str: ...
    def emit(self, type: str, inputs: list[str], outputs: list[str], **attrs: Any) -> list[str]: ...
    def emit1(self, type: str, inputs: list[str], *, like: str, **attrs: Any) -> str: ...
    def unbroadcast(self, grad: str, x: str) -> str: ...
    def reshape_like(self, grad: str, x: str) -> str: ...
    def saved_outputs(self, op: Op, what: list[tuple], count: int) -> list[str]: ...
    def vjp(self, op: Op, dy: list[str | None]) -> list[str | None]: ...


Rule = Callable[[GradBuilder, "Op", list], list]


def grad_rule(*op_types: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for t in op_types:
            if registry.get(t) is None:
                raise ValueError(f"grad rule for unknown op type {t!r}")
            registry.extend(t, grad=fn)
        return fn

    return deco


def _stat_dtype(x_dtype: str) -> str:
    """Norm statistics: float32 for half inputs (torch accumulates in float), else x's dtype."""
    return "float32" if x_dtype in ("float16", "bfloat16") else x_dtype


# --- elementwise --------------------------------------------------------------


@grad_rule("Add")
def _add(g, op, dy):
    return [g.unbroadcast(dy[0], x) if g.needs(i) else None for i, x in enumerate(op.inputs)]


@grad_rule("Sub")
def _sub(g, op, dy):
    a, b = op.inputs
    da = g.unbroadcast(dy[0], a) if g.needs(0) else None
    db = g.unbroadcast(g.emit1("Neg", [dy[0]], like=dy[0]), b) if g.needs(1) else None
    return [da, db]


@grad_rule("Mul")
def _mul(g, op, dy):
    a, b = op.inputs
    da = g.unbroadcast(g.emit1("Mul", [dy[0], b], like=dy[0]), a) if g.needs(0) else None
    db = g.unbroadcast(g.emit1("Mul", [dy[0], a], like=dy[0]), b) if g.needs(1) else None
    return [da, db]


@grad_rule("Div")
def _div(g, op, dy):
    a, b = op.inputs
    da = g.unbroadcast(g.emit1("Div", [dy[0], b], like=dy[0]), a) if g.needs(0) else None
    db = None
    if g.needs(1):  # d(a/b)/db = -(a/b)/b
        t = g.emit1("Div", [op.outputs[0], b], like=dy[0])
        db = g.unbroadcast(g.emit1("Neg", [g.emit1("Mul", [dy[0], t], like=dy[0])], like=dy[0]), b)
    return [da, db]


@grad_rule("Pow")
def _pow(g, op, dy):
    # A constant scalar exponent (x**3 of the tanh GELU, x**2 of a variance): torch's scalar
    # form, n * x**(n-1), without the log(x) term and where() of the tensor-exponent backward.
    x, y = op.inputs
    n = g.constant_value(y)
    if g.needs(1) or not isinstance(n, (int, float)) or isinstance(n, bool):
        return g.vjp(op, dy)
    if g.shape(op.outputs[0]) != g.shape(x) or g.dtype(op.outputs[0]) != g.dtype(x):
        return g.vjp(op, dy)
    return [g.emit1("PowGrad", [dy[0], x], like=x, exponent=float(n)), None]


@grad_rule("Reciprocal")
def _reciprocal(g, op, dy):
    # torch: grad * -(result * result), from the saved output (negation is exact: same bits).
    y = op.outputs[0]
    sq = g.emit1("Mul", [y, y], like=y)
    return [g.emit1("Neg", [g.emit1("Mul", [dy[0], sq], like=y)], like=op.inputs[0])]


@grad_rule("Sqrt")
def _sqrt(g, op, dy):
    # torch: grad / (2 * result), from the saved output.
    y = op.outputs[0]
    two_y = g.emit1("Mul", [y, g.const(2.0, g.dtype(y))], like=y)
    return [g.emit1("Div", [dy[0], two_y], like=op.inputs[0])]


def _one_op(grad_op: str, reads: str | None, attrs: dict[str, Any]) -> Rule:
    """The rule of a unary op whose grad is one op: ``grad_op(dy[, saved], **attrs)``."""

    def rule(g, op, dy):
        saved = {"output": op.outputs[:1], "input": op.inputs[:1], None: []}[reads]
        kw = {k: op.attrs.get(k, default) for k, default in attrs.items()}
        return [g.emit1(grad_op, [dy[0], *saved], like=op.inputs[0], **kw)]

    return rule


# Unary ops whose grad is a single op of dy and, as torch's backward, the forward's output or
# input (None: dy alone), with the attrs it copies from the forward op and their defaults.
_ONE_OP_GRADS: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "Exp": ("Mul", "output", {}),
    "Log": ("Div", "input", {}),
    "Neg": ("Neg", None, {}),
    "Identity": ("Identity", None, {}),
    "Relu": ("ReluGrad", "output", {}),
    "Tanh": ("TanhGrad", "output", {}),
    "Sigmoid": ("SigmoidGrad", "output", {}),
    "Gelu": ("GeluGrad", "input", {"approximate": "none"}),
    "Softmax": ("SoftmaxGrad", "output", {"axis": -1}),
    "LogSoftmax": ("LogSoftmaxGrad", "output", {"axis": -1}),
    "HardSwish": ("HardSwishGrad", "input", {}),
}
for _type, (_grad_op, _reads, _attrs) in _ONE_OP_GRADS.items():
    grad_rule(_type)(_one_op(_grad_op, _reads, _attrs))


@grad_rule("Where")
def _where(g, op, dy):
    # torch: where(cond, grad, 0) and where(cond, 0, grad), each summed to its input's shape.
    cond, a, b = op.inputs
    zero = g.const(0.0, g.dtype(dy[0]))
    da = g.unbroadcast(g.emit1("Where", [cond, dy[0], zero], like=dy[0]), a) if g.needs(1) else None
    db = g.unbroadcast(g.emit1("Where", [cond, zero, dy[0]], like=dy[0]), b) if g.needs(2) else None
    return [None, da, db]


@grad_rule("Cast")
def _cast(g, op, dy):
    x = op.inputs[0]
    return [g.emit1("Cast", [dy[0]], like=x, to=g.onnx_dtype(x))]


@grad_rule("HardSigmoid")
def _hard_sigmoid(g, op, dy):
    attrs = {k: op.attrs[k] for k in ("alpha", "beta") if k in op.attrs}
    return [g.emit1("HardSigmoidGrad", [dy[0], op.inputs[0]], like=op.inputs[0], **attrs)]


@grad_rule("Pad")
def _pad(g, op, dy):
    # A constant-mode pad's grad is the incoming grad with the pads taken off again: a Pad by
    # the negated pads (torch's constant_pad_nd backward; a crop's grad is zeros put back).
    # Reflect / edge / wrap modes fold several positions into one: the generic rule.
    if op.attrs.get("mode", "constant") != "constant":
        return g.vjp(op, dy)
    if len(op.inputs) > 1 and op.inputs[1]:
        pads = _as_ints(g.constant_value(op.inputs[1]))
    else:
        pads = op.attrs.get("pads")
    if pads is None:
        return g.vjp(op, dy)
    axes = op.inputs[3] if len(op.inputs) > 3 else ""
    inputs = [dy[0], g.const([-int(v) for v in pads], "int64"), "", *([axes] if axes else [])]
    return [g.emit1("Pad", inputs, like=op.inputs[0])] + [None] * (len(op.inputs) - 1)


@grad_rule("CastLike")
def _cast_like(g, op, dy):
    x = op.inputs[0]
    return [g.emit1("Cast", [dy[0]], like=x, to=g.onnx_dtype(x)), None]


@grad_rule("Clip")
def _clip(g, op, dy):
    # torch.clamp's backward: the grad where min <= x <= max (both bounds inclusive), else 0.
    x = op.inputs[0]
    bounds = [(b, t) for b, t in zip(op.inputs[1:3], ("GreaterOrEqual", "LessOrEqual")) if b]
    if not bounds:
        return [dy[0]] + [None] * (len(op.inputs) - 1)
    inside = ""
    for bound, test in bounds:
        mask = g.temp(x, dtype="bool")
        g.emit(test, [x, bound], [mask])
        if inside:
            both = g.temp(x, dtype="bool")
            g.emit("And", [inside, mask], [both])
            mask = both
        inside = mask
    zero = g.const(0.0, g.dtype(x))
    return [g.emit1("Where", [inside, dy[0], zero], like=x)] + [None] * (len(op.inputs) - 1)


@grad_rule("ReduceL2")
def _reduce_l2(g, op, dy):
    # torch's norm backward for p=2: x * (grad / norm), 0 where the norm is 0 (F.normalize).
    x, norm = op.inputs[0], op.outputs[0]
    xs = g.var(x).shape
    axes = _reduce_axes(g, op, None if xs is None else len(xs))
    if xs is None or axes is None:
        return g.vjp(op, dy)
    grad, norm = _with_kept_dims(g, op, dy[0], axes), _with_kept_dims(g, op, norm, axes)
    kept = g.shape(grad)
    scale = g.temp(x, shape=kept)
    g.emit("Div", [grad, norm], [scale])
    is_zero = g.temp(x, shape=kept, dtype="bool")
    zero = g.const(0.0, g.dtype(x))
    g.emit("Equal", [norm, zero], [is_zero])
    safe = g.temp(x, shape=kept)
    g.emit("Where", [is_zero, zero, scale], [safe])
    return [g.emit1("Mul", [x, safe], like=x)] + [None] * (len(op.inputs) - 1)


@grad_rule("Einsum")
def _einsum(g, op, dy):
    # The grad of each operand is another einsum: the output grad with the other operand, onto
    # this operand's labels ("td,dnh->tnh": d(dnh) = "tnh,td->dnh"). Two operands, explicit
    # output, no ellipsis, no label repeated within an operand, and every label of an operand
    # in the output or the other operand (a label summed from one operand alone would need a
    # broadcast back); anything else keeps the generic rule.
    spec = _einsum_spec(op.attrs.get("equation", ""))
    if spec is None or len(op.inputs) != 2:
        return g.vjp(op, dy)
    (a, b), out = spec
    grads = []
    for i, (mine, other, other_name) in enumerate(((a, b, op.inputs[1]), (b, a, op.inputs[0]))):
        if not g.needs(i):
            grads.append(None)
            continue
        grads.append(
            g.emit1("Einsum", [dy[0], other_name], like=op.inputs[i], equation=f"{out},{other}->{mine}")
        )
    return grads


def _einsum_spec(equation: str) -> tuple[tuple[str, str], str] | None:
    eq = equation.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2 or any(len(set(t)) != len(t) for t in (*ops, out)):
        return None
    a, b = ops
    if any(c not in out and c not in other for t, other in ((a, b), (b, a)) for c in t):
        return None
    return (a, b), out


# --- shape ops ----------------------------------------------------------------


@grad_rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(g, op, dy):
    return [g.reshape_like(dy[0], op.inputs[0])] + [None] * (len(op.inputs) - 1)


@grad_rule("Transpose")
def _transpose(g, op, dy):
    perm = op.attrs.get("perm") or list(range(len(g.shape(op.inputs[0])) - 1, -1, -1))
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return [g.emit1("Transpose", [dy[0]], like=op.inputs[0], perm=inv)]


@grad_rule("Expand")
def _expand(g, op, dy):
    # The broadcast dims summed back (torch's sum_to_size): no re-run of the forward under
    # autograd, which the generic rule costs (LLaMA's repeat_kv expands K and V per layer).
    xs, ys = g.var(op.inputs[0]).shape, g.var(op.outputs[0]).shape
    if xs is None or ys is None or len(ys) < len(xs):
        return g.vjp(op, dy)
    return [g.unbroadcast(dy[0], op.inputs[0]), None]


@grad_rule("ReduceSum", "ReduceMean")
def _reduce_sum_mean(g, op, dy):
    # The grad broadcast back over the reduced axes (divided by their size for a mean), as
    # torch's sum_backward / mean_backward: no re-run of the forward under autograd. Needs
    # constant axes of static size (a symbolic batch dim may stay, unreduced: the broadcast
    # keeps it from the grad).
    x = op.inputs[0]
    xs = g.var(x).shape
    axes = _reduce_axes(g, op, None if xs is None else len(xs))
    if axes is None:
        return g.vjp(op, dy)
    if any(not isinstance(xs[a], int) for a in axes):  # over tokens (an MoE aux loss's mean)
        attrs = {"axes": axes, "keepdims": op.attrs.get("keepdims", 1), "mean": int(op.type == "ReduceMean")}
        return [g.emit1("ReduceGrad", [dy[0], x], like=x, **attrs)] + [None] * (len(op.inputs) - 1)
    grad = _with_kept_dims(g, op, dy[0], axes)
    if op.type == "ReduceMean":
        n = math.prod(xs[a] for a in axes)
        grad, prev = g.temp(x, shape=g.shape(grad)), grad
        g.emit("Div", [prev, g.const(float(n), g.dtype(x))], [grad])
    target = [d if isinstance(d, int) else 1 for d in xs]
    return [g.emit1("Expand", [grad, g.const(target, "int64")], like=x)] + [None] * (len(op.inputs) - 1)


def _with_kept_dims(g, op, value: str, axes: list[int]) -> str:
    """A reduce op's output-shaped `value` with the reduced axes back as 1s (itself when the op
    kept them: keepdims=1)."""
    if op.attrs.get("keepdims", 1):
        return value
    x = op.inputs[0]
    kept = tuple(1 if i in axes else d for i, d in enumerate(g.var(x).shape))
    out = g.temp(x, shape=kept)
    g.emit("Unsqueeze", [value, g.const(axes, "int64")], [out])
    return out


def _reduce_axes(g, op, rank: int | None) -> list[int] | None:
    """The sorted non-negative axes a ReduceSum/ReduceMean reduces, or None when they are not
    known before running (axes from a value) or the op reduces nothing (noop_with_empty_axes)."""
    if rank is None:
        return None
    if len(op.inputs) > 1 and op.inputs[1]:
        axes = _as_ints(g.constant_value(op.inputs[1]))
        if axes is None:
            return None
    else:
        axes = list(op.attrs.get("axes") or [])
    if not axes:
        if op.attrs.get("noop_with_empty_axes", 0):
            return None
        axes = list(range(rank))
    return sorted({a % rank for a in axes}) if rank else []


@grad_rule("Slice")
def _slice(g, op, dy):
    # A unit-step slice with constant bounds along static dims: its grad is the incoming grad
    # padded with zeros back to the input's shape (torch's slice_backward: zeros, then the
    # slice written), so the backward keeps neither the input nor a re-run of the forward.
    pads = _slice_pads(g, op)
    if pads is None:
        strided = _strided_slice(g, op)
        if strided is None:
            return g.vjp(op, dy)
        grad = g.emit1("SliceGrad", [dy[0]], like=op.inputs[0], **strided)
        return [grad] + [None] * (len(op.inputs) - 1)
    axes, before, after = pads
    if not any(before) and not any(after):  # x[:, ...]: the whole input, its grad as it came
        return [dy[0]] + [None] * (len(op.inputs) - 1)
    grad = g.emit1(
        "Pad", [dy[0], g.const(before + after, "int64"), "", g.const(axes, "int64")], like=op.inputs[0]
    )
    return [grad] + [None] * (len(op.inputs) - 1)


def _slice_bounds(g, op) -> tuple[tuple, list[int], list[int], list[int], list[int]] | None:
    """(input shape, starts, ends, axes, steps) of a Slice whose bounds are constants (axes and
    steps filled in where omitted), or None (run-time bounds, an unknown rank, the legacy
    attribute form)."""
    xs = g.var(op.inputs[0]).shape
    if xs is None or len(op.inputs) < 3:
        return None
    bounds = [g.constant_value(x) if x else None for x in op.inputs[1:5]]
    bounds += [None] * (4 - len(bounds))
    starts, ends, axes, steps = (_as_ints(b) for b in bounds)
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    if len(axes) != len(starts) or len(steps) != len(starts):
        return None
    return xs, starts, ends, axes, steps


def _slice_pads(g, op) -> tuple[list[int], list[int], list[int]] | None:
    """(axes, zeros before, zeros after) that pad a Slice's output back to its input, or None
    where the rule does not apply (bounds computed at run time, a step other than 1, a sliced
    dim of unknown size, the legacy attribute form)."""
    bounds = _slice_bounds(g, op)
    if bounds is None:
        return None
    xs, starts, ends, axes, steps = bounds
    if any(s != 1 for s in steps):
        return None
    rank = len(xs)
    out_axes, before, after = [], [], []
    for ax, start, end in zip(axes, starts, ends, strict=True):
        ax = ax % rank
        n = xs[ax]
        if not isinstance(n, int):
            if start != 0 or end < _TO_THE_END:  # a symbolic dim (the batch) taken whole only
                return None
            n = 0
        lo, hi = slice(start, end).indices(n)[:2]  # ONNX clamps as Python does, for step 1
        out_axes.append(ax)
        before.append(lo)
        after.append(n - max(hi, lo))
    return out_axes, before, after


def _strided_slice(g, op) -> dict | None:
    """SliceGrad's attrs for a Slice with constant bounds and positive steps (x[:, ::2], Swin's
    patch merging), or None (run-time bounds, a negative step, a sliced dim of unknown size)."""
    bounds = _slice_bounds(g, op)
    if bounds is None:
        return None
    xs, starts, ends, axes, steps = bounds
    if any(s <= 0 for s in steps):
        return None
    rank = len(xs)
    norm_axes, norm_starts = [], []
    for ax, start, end, step in zip(axes, starts, ends, steps, strict=True):
        n = xs[ax % rank]
        if not isinstance(n, int):
            return None
        norm_axes.append(ax % rank)
        norm_starts.append(slice(start, end, step).indices(n)[0])
    sizes = [d if isinstance(d, int) else -1 for d in xs]
    return {"sizes": sizes, "axes": norm_axes, "starts": norm_starts, "steps": list(steps)}


_TO_THE_END = 2**31 - 1  # an end at least this large takes a dim to its end (exporters write INT64_MAX)


def _as_ints(value) -> list[int] | None:
    """A constant's value as a list of ints (a scalar as one), None for none."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [int(value)]
    return [int(v) for v in value.reshape(-1).tolist()]


@grad_rule("Split")
def _split(g, op, dy):
    parts = [d if d is not None else g.emit1("ZerosLike", [o], like=o) for d, o in zip(dy, op.outputs)]
    axis = op.attrs.get("axis", 0)
    return [g.emit1("Concat", parts, like=op.inputs[0], axis=axis)] + [None] * (len(op.inputs) - 1)


@grad_rule("Concat")
def _concat(g, op, dy):
    axis = op.attrs.get("axis", 0)
    sizes = [g.shape(x)[axis] for x in op.inputs]
    if not all(isinstance(s, int) for s in sizes):
        return g.vjp(op, dy)
    outs = g.emit("Split", [dy[0], g.const(sizes, "int64")], [g.contrib(x) for x in op.inputs], axis=axis)
    return [o if g.needs(i) else None for i, o in enumerate(outs)]


# --- layers -------------------------------------------------------------------


@grad_rule("Linear")
def _linear(g, op, dy):
    x, w = op.inputs[:2]
    outs, mask = g.contribs()
    g.emit("LinearGrad", [dy[0], x, w], outs, mask=mask)
    return [o or None for o in outs]


@grad_rule("MatMul")
def _matmul(g, op, dy):
    a, b = op.inputs
    if len(g.shape(a)) < 2 or len(g.shape(b)) < 2:
        return g.vjp(op, dy)
    outs, mask = g.contribs()
    g.emit("MatMulGrad", [dy[0], a, b], outs, mask=mask)
    return [o or None for o in outs]


@grad_rule("GroupedMatMul")
def _grouped_matmul(g, op, dy):
    # The offsets are routing (integers): no grad. dx and dweight in one op, per group.
    x, w, offsets = op.inputs
    outs, mask = g.contribs(2)
    g.emit("GroupedMatMulGrad", [dy[0], x, w, offsets], outs, mask=mask)
    return [outs[0] or None, outs[1] or None, None]


@grad_rule("GatherND")
def _gather_nd(g, op, dy):
    # Indexing by a tensor of indices (Swin's relative-position bias table): the grad is summed
    # into zeros at the gathered places; the data itself is not read. Needs the data's shape.
    # A symbolic dim (tokens routed to experts): the data's shape read at run time instead.
    shape = g.var(op.inputs[0]).shape
    if shape is None:
        return g.vjp(op, dy)
    batch_dims = op.attrs.get("batch_dims", 0)
    if not all(isinstance(d, int) for d in shape):
        ins = [dy[0], op.inputs[1], op.inputs[0]]
        return [g.emit1("GatherNDGrad", ins, like=op.inputs[0], batch_dims=batch_dims), None]
    attrs = {"sizes": list(shape), "batch_dims": batch_dims}
    return [g.emit1("GatherNDGrad", [dy[0], op.inputs[1]], like=op.inputs[0], **attrs), None]


@grad_rule("TopK")
def _topk(g, op, dy):
    # torch's value_selecting_reduction_backward: the values' grad put at their indices along the
    # axis, zeros elsewhere (a router's top-k probabilities). The input is read for its shape.
    if dy[0] is None:
        return [None, None]
    x, idx = op.inputs[0], op.outputs[1]
    return [g.emit1("TopKGrad", [dy[0], idx, x], like=x, axis=op.attrs.get("axis", -1)), None]


@grad_rule("AveragePool")
def _average_pool(g, op, dy):
    # torch's avg_pool backward (AveragePoolGrad reads x for its shape): no re-run of the
    # pooling under autograd, which the generic rule costs (DenseNet's transitions).
    return [g.emit1("AveragePoolGrad", [dy[0], op.inputs[0]], like=op.inputs[0], **op.attrs)]


@grad_rule("MaxPool")
def _max_pool(g, op, dy):
    # The forward also gives the argmax indices (ONNX's optional output 1) and MaxPoolGrad
    # scatters the grad there: the generic Vjp would run the pooling a second time.
    x = op.inputs[0]
    if (
        not g.needs(0)
        or len(g.shape(x)) != 4
        or g.dtype(x) not in ("float32", "float64", "float16", "bfloat16")
    ):
        return g.vjp(op, dy)
    (idx,) = g.saved_outputs(op, [("INDICES", g.shape(op.outputs[0]), "int64")], count=2)
    dx = g.contrib(x)
    g.emit("MaxPoolGrad", [dy[0], x, idx], [dx], **op.attrs)
    return [dx]


@grad_rule("Gemm")
def _gemm(g, op, dy):
    # Y = alpha * A'B' + beta * C, A' = A^T if transA, B' = B^T if transB (2-D only).
    a, b = op.inputs[:2]
    c = op.inputs[2] if len(op.inputs) > 2 and op.inputs[2] else None
    alpha, beta = op.attrs.get("alpha", 1.0), op.attrs.get("beta", 1.0)
    ta, tb = op.attrs.get("transA", 0), op.attrs.get("transB", 0)
    d = dy[0]
    out: list = [None, None]
    if g.needs(0):  # dA = alpha dY B'^T, or its transpose B' dY^T when transA
        ins, kw = ([b, d], {"transA": tb, "transB": 1}) if ta else ([d, b], {"transA": 0, "transB": 1 - tb})
        out[0] = g.emit1("Gemm", ins, like=a, alpha=alpha, **kw)
    if g.needs(1):  # dB = alpha A'^T dY, or its transpose dY^T A' when transB
        ins, kw = ([d, a], {"transA": 1, "transB": ta}) if tb else ([a, d], {"transA": 1 - ta, "transB": 0})
        out[1] = g.emit1("Gemm", ins, like=b, alpha=alpha, **kw)
    if c is not None:
        dc = d if beta == 1.0 else g.emit1("Mul", [d, g.const(beta, g.dtype(d))], like=d)
        out.append(g.unbroadcast(dc, c) if g.needs(2) else None)
    return out


@grad_rule("Gather")
def _gather(g, op, dy):
    data, idx = op.inputs
    if op.attrs.get("axis", 0) == 0 and len(g.shape(data)) == 2 and g.var(data).persistable:
        return _lookup_grad(g, op, dy)
    return _gather_one(g, op, dy) or g.vjp(op, dy)


def _gather_one(g, op, dy) -> list | None:
    """x[:, k] (ViT's class token, a last position): a Gather of one constant index along a
    static axis. Its grad is the incoming grad put back at k along that axis, zeros elsewhere:
    an Unsqueeze and a Pad, neither holding x nor re-running the forward."""
    data, idx = op.inputs
    k, shape = g.constant_value(idx), g.var(data).shape
    if not isinstance(k, int) or g.var(idx).shape != () or shape is None:
        return None
    axis = op.attrs.get("axis", 0) % len(shape)
    size = shape[axis]
    if not isinstance(size, int) or not -size <= k < size:
        return None
    k %= size
    kept = tuple(1 if i == axis else d for i, d in enumerate(shape))
    grad = g.temp(data, shape=kept)
    g.emit("Unsqueeze", [dy[0], g.const([axis], "int64")], [grad])
    pads = g.const([k, size - 1 - k], "int64")
    return [g.emit1("Pad", [grad, pads, "", g.const([axis], "int64")], like=data), None]


def _lookup_grad(g, op, dy):
    """A table lookup's weight grad (Gather of a param on axis 0, or our Embedding, whose
    padding_idx / scale_grad_by_freq attrs pass through); none for the indices."""
    weight, idx = op.inputs
    attrs = {k: op.attrs[k] for k in ("padding_idx", "scale_grad_by_freq") if k in op.attrs}
    return [g.emit1("EmbeddingGrad", [dy[0], idx, weight], like=weight, **attrs), None]


grad_rule("Embedding")(_lookup_grad)


@grad_rule("LayerNormalization")
def _layer_norm(g, op, dy):
    x, scale = op.inputs[:2]
    bias = op.inputs[2] if len(op.inputs) > 2 and op.inputs[2] else None
    axis = op.attrs.get("axis", -1)
    if g.shape(scale) != g.shape(x)[axis:] or op.attrs.get("stash_type", 1) != 1:
        return g.vjp(op, dy)
    xs = g.shape(x)
    stat = tuple(xs[: axis % len(xs)]) + (1,) * (len(xs) - axis % len(xs))  # ONNX keeps the dims
    sd = _stat_dtype(g.dtype(x))
    mean, rstd = g.saved_outputs(op, [("MEAN", stat, sd), ("RSTD", stat, sd)], count=3)
    ins = [dy[0], x, mean, rstd, scale] + ([bias] if bias else [])
    outs, mask = g.contribs(3 if bias else 2)
    g.emit("LayerNormGrad", ins, outs, axis=axis, mask=mask)
    return [o or None for o in outs]


@grad_rule("RMSNorm")
def _rms_norm(g, op, dy):
    outs, mask = g.contribs(2)
    g.emit("RMSNormGrad", [dy[0], *op.inputs], outs, epsilon=op.attrs.get("epsilon", 1e-6), mask=mask)
    return [o or None for o in outs]


@grad_rule("Silu")
def _silu(g, op, dy):
    return [g.emit1("SiluGrad", [dy[0], op.inputs[0]], like=op.inputs[0])]


@grad_rule("QuickGelu")
def _quick_gelu(g, op, dy):
    return [g.emit1("QuickGeluGrad", [dy[0], op.inputs[0]], like=op.inputs[0], alpha=op.attrs["alpha"])]


@grad_rule("Swish")
def _swish(g, op, dy):
    if op.attrs.get("alpha", 1.0) != 1.0:
        return g.vjp(op, dy)
    return [g.emit1("SiluGrad", [dy[0], op.inputs[0]], like=op.inputs[0])]


@grad_rule("Rotary")
def _rotary(g, op, dy):
    # cos and sin come from buffers (inv_freq) and positions in every model we know: a grad for
    # them takes the generic rule.
    if g.needs(1) or g.needs(2):
        return g.vjp(op, dy)
    x, cos, sin = op.inputs
    return [g.emit1("RotaryGrad", [dy[0], cos, sin], like=x), None, None]


@grad_rule("SiluMul")
def _silu_mul(g, op, dy):
    outs, mask = g.contribs(2)
    g.emit("SiluMulGrad", [dy[0], *op.inputs], outs, mask=mask)
    return [o or None for o in outs]


@grad_rule("BatchNormTraining")
def _batch_norm_training(g, op, dy):
    x, scale, bias = op.inputs[:3]
    c, sd = g.shape(scale), _stat_dtype(g.dtype(x))
    mean, invstd = g.saved_outputs(op, [("SAVE_MEAN", c, sd), ("SAVE_INVSTD", c, sd)], count=5)
    eps = op.attrs.get("epsilon", 1e-5)
    outs, mask = g.contribs(3)
    g.emit("BatchNormTrainingGrad", [dy[0], x, scale, mean, invstd], outs, epsilon=eps, mask=mask)
    return [o or None for o in outs] + [None, None]


@grad_rule("Conv")
def _conv(g, op, dy):
    x, w = op.inputs[:2]
    b = op.inputs[2] if len(op.inputs) > 2 and op.inputs[2] else None
    nd = len(g.shape(w)) - 2
    pads = op.attrs.get("pads", [0] * (2 * nd))
    if op.attrs.get("auto_pad", "NOTSET") != "NOTSET" or pads[:nd] != pads[nd:]:
        return g.vjp(op, dy)
    keys = ("strides", "pads", "dilations", "group", "memory_format")
    attrs = {k: op.attrs[k] for k in keys if k in op.attrs}
    outs, mask = g.contribs(3 if b else 2)
    g.emit("ConvGrad", [dy[0], x, w], outs, mask=mask, **attrs)
    return [o or None for o in outs]


@grad_rule("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(g, op, dy):
    scores, labels = op.inputs[:2]
    weights = op.inputs[2] if len(op.inputs) > 2 and op.inputs[2] else None
    (log_prob,) = g.saved_outputs(op, [("LOG_PROB", g.shape(scores), g.dtype(scores))], count=2)
    attrs = {k: op.attrs[k] for k in ("ignore_index", "reduction") if k in op.attrs}
    ins = [dy[0], log_prob, labels] + ([weights] if weights else [])
    return [g.emit1("SoftmaxCrossEntropyLossGrad", ins, like=scores, **attrs), None, None][: len(op.inputs)]


@grad_rule("Dropout")
def _dropout(g, op, dy):
    train = op.inputs[2] if len(op.inputs) > 2 and op.inputs[2] else ""
    if not train or g.constant_value(train) is False:  # inference semantics: the identity
        return [g.emit1("Identity", [dy[0]], like=op.inputs[0])] + [None] * (len(op.inputs) - 1)
    (mask,) = g.saved_outputs(op, [("MASK", g.shape(op.outputs[0]), "bool")], count=2)
    ratio = op.inputs[1] if len(op.inputs) > 1 and op.inputs[1] else g.const(0.5, "float32")
    # A run-time training flag is read by the grad kernel too.
    ins = [dy[0], mask, ratio] + ([] if g.constant_value(train) is True else [train])
    return [g.emit1("DropoutGrad", ins, like=op.inputs[0])] + [None] * (len(op.inputs) - 1)


@grad_rule("LinearCrossEntropy")
def _linear_cross_entropy(g, op, dy):
    # Nothing of the forward's [N, V] logits is saved, so nothing that size lives between forward
    # and backward. In float32 / float64 the forward makes the grads for a loss grad of 1 while it
    # has each chunk's logits (ops/kernels/loss.py `_lce_with_unit_grads`) and the backward scales
    # them (`ScaleGrads`): the logits are made once. Otherwise (AMP's half precision, where an
    # unscaled grad would underflow) one grad op recomputes the logits chunk by chunk.
    x, w, labels = op.inputs[:3]
    bias = op.inputs[3] if len(op.inputs) > 3 and op.inputs[3] else ""
    params = [x, w] + ([bias] if bias else [])
    if all(g.dtype(v) == g.dtype(x) for v in params) and g.dtype(x) in ("float32", "float64"):
        tags = ("GRAD_X", "GRAD_W", "GRAD_B")
        what = [(tag, g.shape(v), g.dtype(v)) for tag, v in zip(tags, params, strict=False)]
        units = g.saved_outputs(op, what, count=1 + len(what))
        # every grad is made in the forward (a frozen head's weight grad too: one matmul spent)
        made: dict[int, str] = {}
        for v, i in zip(params, (0, 1, 3), strict=False):
            if g.needs(i):
                made[i] = g.contrib(v)
        if made:
            ins = [dy[0]] + [u for u, i in zip(units, (0, 1, 3), strict=False) if i in made]
            g.emit("ScaleGrads", ins, list(made.values()))
        return [made.get(0), made.get(1), None] + ([made.get(3)] if bias else [])
    attrs = {k: op.attrs[k] for k in ("ignore_index", "reduction", "chunk_size", "transB") if k in op.attrs}
    outs = [g.contrib(x) if g.needs(0) else "", g.contrib(w) if g.needs(1) else ""]
    if bias:
        outs.append(g.contrib(bias) if g.needs(3) else "")
    mask = [int(bool(o)) for o in outs]
    ins = [dy[0], x, w, labels] + ([bias] if bias else [])
    g.emit("LinearCrossEntropyGrad", ins, outs, mask=mask, **attrs)
    return [outs[0] or None, outs[1] or None, None] + ([outs[2] or None] if bias else [])

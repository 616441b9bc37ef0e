"""Rotary position embedding as one op: ``Rotary(x, cos, sin)``.

Hugging Face's decoders (LLaMA, Mistral, Qwen, Phi, GPT-NeoX ...) apply rotary embeddings as
``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])``,
which torch exports as seven ops per query and per key (Mul, two Slices, Neg, Concat, Mul, Add).
Their generic gradients re-ran the slices under autograd; and a Slice of the head dim had no
tensor-parallel split rule, so no decoder's attention could be split over heads. One op per
rotation has a two-op gradient that reads cos and sin only (not x), and is elementwise over every
dim but the last (passes/tensor_parallel splits it over heads).

Same ops, same order as the exported chain: the fused result is the chain's bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from metaopt.ops import onnx_bodies, patterns
from metaopt.ops.registry import register


@register("Rotary", domain="metaopt", onnx_function=onnx_bodies.rotary)
def rotary(X: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``X * cos + rotate_half(X) * sin`` over X's last dim (cos and sin broadcast to X)."""
    return X * cos + rotate_half(X) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` of the last dim's halves x1, x2."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def fuse_rotary(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """Concat's `fuse` rule: ``Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h:)), Slice(x, :h)), sin))``
    (operands of Mul and Add in either order) over x's last dim of static even size 2h is
    ``Rotary(x, cos, sin)``. Every absorbed value has one reader; cos and sin must broadcast to x
    without widening it, in x's dtype."""
    from metaopt.ir import Op

    cat = q.ops[i]
    if len(cat.inputs) != 2:
        return None
    neg_at, x1_at = producer.get(cat.inputs[0]), producer.get(cat.inputs[1])
    if neg_at is None or x1_at is None or q.ops[neg_at].type != "Neg":
        return None
    x2_at = producer.get(q.ops[neg_at].inputs[0])
    if x2_at is None or any(patterns.one_reader(consumers, q.ops[j].outputs[0]) != r for j, r in
                            ((neg_at, i), (x1_at, i), (x2_at, neg_at))):  # fmt: skip
        return None
    x = _half_of(q, q.ops[x1_at], first=True)
    if x is None or _half_of(q, q.ops[x2_at], first=False) != x:
        return None
    xv = q.vars[x]
    if cat.attrs.get("axis", 0) not in (-1, len(xv.shape) - 1):
        return None
    m1_at = patterns.one_reader(consumers, cat.outputs[0])
    sin = _other_operand(q, m1_at, cat.outputs[0], "Mul")
    add_at = patterns.one_reader(consumers, q.ops[m1_at].outputs[0]) if sin else None
    m0 = _other_operand(q, add_at, q.ops[m1_at].outputs[0], "Add") if add_at is not None else None
    m0_at = producer.get(m0) if m0 else None
    if m0_at is None or patterns.one_reader(consumers, m0) != add_at:
        return None
    cos = _other_operand(q, m0_at, x, "Mul")
    y = q.ops[add_at].outputs[0]
    if cos is None or not all(_fits(q, t, xv) for t in (cos, sin, y)) or q.vars[y].shape != xv.shape:
        return None
    absorbed = [neg_at, x1_at, x2_at, m1_at, m0_at, add_at]
    return absorbed, Op("Rotary", [x, cos, sin], [y], {}, role=cat.role, scope=q.ops[add_at].scope)


def _half_of(q: Any, op: Any, *, first: bool) -> str | None:
    """The x that `op` slices to its first (or second) half over the last dim, else None."""
    if op.type != "Slice" or len(op.inputs) < 4:
        return None
    x = op.inputs[0]
    shape = q.vars[x].shape
    if not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    vals = [patterns.int_constant(q, name) if name else None for name in op.inputs[1:5]]
    starts, ends, axes = vals[:3]
    steps = vals[3] if len(vals) > 3 and len(op.inputs) > 4 and op.inputs[4] else [1]
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if len(starts) != 1 or axes[0] not in (-1, len(shape) - 1) or steps != [1]:
        return None
    d = shape[-1]
    lo, hi = slice(starts[0], ends[0]).indices(d)[:2]
    return x if (lo, hi) == ((0, d // 2) if first else (d // 2, d)) else None


def _other_operand(q: Any, at: int | None, one: str, op_type: str) -> str | None:
    """The input of binary op `at` (of `op_type`) other than `one`, else None."""
    if at is None or q.ops[at].type != op_type or len(q.ops[at].inputs) != 2 or one not in q.ops[at].inputs:
        return None
    a, b = q.ops[at].inputs
    return b if a == one else a


def _fits(q: Any, name: str, xv: Any) -> bool:
    """Is `name` of x's dtype, and of a shape that broadcasts to x's without widening it?"""
    v = q.vars[name]
    if v.dtype != xv.dtype or v.dtype not in patterns.FLOAT_DTYPES or v.shape is None or xv.shape is None:
        return False
    if len(v.shape) > len(xv.shape):
        return False
    return all(d == 1 or d == e for d, e in zip(v.shape[::-1], xv.shape[::-1]))

"""Elementwise ONNX ops: arithmetic, comparison, logic, bitwise and parameter-free math.

Where an ONNX op is exactly a torch function, the torch function itself is the kernel:
no Python frame sits between the executor and ATen.
"""

from __future__ import annotations

import torch

from metaopt.ops.kernels.activation import fuse_erf_gelu, fuse_silu, fuse_tanh_gelu
from metaopt.ops.registry import LONE_INPUT, SAME, register

# ONNX op type -> torch function with identical semantics (same dtypes, broadcasting, NaN rules).
_DIRECT = {
    # arithmetic
    "Mul": torch.mul,
    "Neg": torch.neg,
    "Abs": torch.abs,
    "Sign": torch.sign,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Round": torch.round,  # half to even, as ONNX
    "Reciprocal": torch.reciprocal,
    "Sqrt": torch.sqrt,
    "Exp": torch.exp,
    "Log": torch.log,
    # trigonometric / hyperbolic
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Tan": torch.tan,
    "Asin": torch.asin,
    "Acos": torch.acos,
    "Atan": torch.atan,
    "Sinh": torch.sinh,
    "Cosh": torch.cosh,
    "Asinh": torch.asinh,
    "Acosh": torch.acosh,
    "Atanh": torch.atanh,
    # parameter-free activations
    "Relu": torch.relu,
    "Sigmoid": torch.sigmoid,
    # comparison
    "Equal": torch.eq,
    # logic (inputs are bool)
    "Not": torch.logical_not,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
    # bitwise
    "BitwiseAnd": torch.bitwise_and,
    "BitwiseOr": torch.bitwise_or,
    "BitwiseXor": torch.bitwise_xor,
    "IsNaN": torch.isnan,
    "Where": torch.where,
}
# Exponentials, logarithms and their kin overflow or lose digits in half precision: AMP keeps
# them in float32 (the rows' amp="black"; every other op above is gray).
_AMP_FLOAT32 = frozenset({"Exp", "Log", "Reciprocal", "Acos", "Asin", "Cosh", "Sinh", "Tan"})


def _dense(x: torch.Tensor) -> bool:
    """Does `x` cover its elements exactly once (no broadcast stride, no gaps)? The plan only
    picks storages a kernel made fresh; this guards a kernel that returned an expanded view."""
    return x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)


def _unary_into(fn_, inplace):
    """`reuse` for a unary op: its in-place torch function (relu_), else the kernel."""

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return inplace(x) if _dense(x) else fn_(x)

    return lambda j: kernel


def _binary_into(fn_, kernel_):
    """`reuse` for a binary op: ATen's elementwise loop writing into input j (out= may be an
    input: an exact overlap is allowed), else the out-of-place kernel (unsigned fallbacks)."""

    def into(j: int):
        def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            target = b if j else a
            if not _dense(target):
                return kernel_(a, b)
            try:
                return fn_(a, b, out=target)
            except NotImplementedError:
                return kernel_(a, b)

        return kernel

    return into


# The ops that may write into an input dying at them (ops/reuse.py).
_UNARY_REUSE = {"Relu": torch.relu_, "Sigmoid": torch.sigmoid_, "Neg": torch.neg_}
for _type, _fn in _DIRECT.items():
    _reuse = ((0,), _unary_into(_fn, _UNARY_REUSE[_type])) if _type in _UNARY_REUSE else None
    if _type == "Mul":
        _reuse = ((0, 1), _binary_into(torch.mul, torch.mul))
    _fuse = fuse_silu if _type == "Sigmoid" else None  # nn.SiLU, the gated MLP's SiLU(a) * b
    register(_type, amp="black" if _type in _AMP_FLOAT32 else "gray", reuse=_reuse, fuse=_fuse)(_fn)
# The anchors of the GELU chains torch exports: their rows fold them into one Gelu.
register("Tanh", fuse=fuse_tanh_gelu)(torch.tanh)
register("Erf", fuse=fuse_erf_gelu)(torch.erf)


# torch has almost no CPU kernels for uint16/32/64 (add, compare, divide, ... raise
# NotImplementedError). The kernels below call torch first, zero-cost while it works, and only
# on that error redo the op in int64, where the result is exact.
_WIDE = (torch.uint16, torch.uint32, torch.uint64)
_SIGN_BIT = -(2**63)
_RING, _ORDER, _ORDER_VALUE, _DIVIDE = range(4)


def _unsigned(fn, kind: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = a.dtype
    if dtype != torch.uint64:  # every uint16/32 value fits int64
        out = fn(a.to(torch.int64), b.to(torch.int64))
        return out if kind == _ORDER else out.to(dtype)
    sa, sb = a.view(torch.int64), b.view(torch.int64)
    if kind == _RING:  # two's complement wraps exactly like unsigned arithmetic
        return fn(sa, sb).view(dtype)
    if kind == _DIVIDE:
        if bool((sa < 0).any()) or bool((sb < 0).any()):
            raise NotImplementedError(f"{fn.__name__} of uint64 values >= 2**63 is not supported")
        return fn(sa, sb).view(dtype)
    # Flipping the sign bit maps unsigned order onto signed order.
    out = fn(sa ^ _SIGN_BIT, sb ^ _SIGN_BIT)
    return out if kind == _ORDER else (out ^ _SIGN_BIT).view(dtype)


def _binary(fn, kind: int):
    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        try:
            return fn(a, b)
        except NotImplementedError:
            if a.dtype not in _WIDE:
                raise
            return _unsigned(fn, kind, a, b)

    kernel.__name__ = fn.__name__
    return kernel


def _div_trunc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.div(a, b, rounding_mode="trunc")


add = _binary(torch.add, _RING)
register("Add", reuse=((0, 1), _binary_into(torch.add, add)))(add)
_sub = _binary(torch.sub, _RING)
register("Sub", reuse=((0, 1), _binary_into(torch.sub, _sub)))(_sub)
register("Less")(_binary(torch.lt, _ORDER))
register("LessOrEqual")(_binary(torch.le, _ORDER))
register("Greater")(_binary(torch.gt, _ORDER))
register("GreaterOrEqual")(_binary(torch.ge, _ORDER))
_maximum = _binary(torch.maximum, _ORDER_VALUE)
_minimum = _binary(torch.minimum, _ORDER_VALUE)
_int_div = _binary(_div_trunc, _DIVIDE)
_remainder = _binary(torch.remainder, _DIVIDE)
_fmod = _binary(torch.fmod, _DIVIDE)


@register("Div")
def div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point():
        return torch.div(a, b)
    # ONNX integer division truncates toward zero (C semantics), torch's `//` floors.
    return _int_div(a, b)


@register("BitwiseNot")
def bitwise_not(x: torch.Tensor) -> torch.Tensor:
    try:
        return torch.bitwise_not(x)
    except NotImplementedError:
        if x.dtype not in _WIDE:
            raise
        # ~x in int64 then wrapped to the unsigned width is the unsigned complement.
        if x.dtype == torch.uint64:
            return torch.bitwise_not(x.view(torch.int64)).view(x.dtype)
        return torch.bitwise_not(x.to(torch.int64)).to(x.dtype)


@register("Pow", amp="black")
def pow_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point() and y.dim() == 0 and y.device.type == "cpu":
        # torch's scalar-exponent kernel (x**2 as x*x, x**3 as x*x*x ...), the one eager
        # `x ** 3` runs; the tensor-exponent one calls std::pow per element.
        y = y.item()
    out = torch.pow(x, y)
    # ONNX allows a differently typed exponent; the result keeps the base's type.
    return out if out.dtype == x.dtype else out.to(x.dtype)


@register("Mod")
def mod(a: torch.Tensor, b: torch.Tensor, fmod: int = 0) -> torch.Tensor:
    # fmod=0 is Python/numpy `%` (sign of the divisor), fmod=1 is C fmod (sign of the dividend).
    return _fmod(a, b) if fmod else _remainder(a, b)


# torch lacks shifts for uint16/32/64; those run in int64, where the result's low bits are identical.
_SHIFT_WIDE = {torch.uint16: 16, torch.uint32: 32, torch.uint64: 64}


@register("BitShift")
def bit_shift(x: torch.Tensor, y: torch.Tensor, direction: str = "") -> torch.Tensor:
    dtype = x.dtype
    bits = _SHIFT_WIDE.get(dtype)
    if bits is None:
        return torch.bitwise_left_shift(x, y) if direction == "LEFT" else torch.bitwise_right_shift(x, y)
    if bits == 64:
        xs, ys = x.view(torch.int64), y.view(torch.int64)
        if direction == "LEFT":
            return torch.bitwise_left_shift(xs, ys).view(dtype)
        # A logical right shift of the signed view: mask off the copies of the sign bit.
        out = torch.bitwise_right_shift(xs, ys)
        keep = torch.where(ys > 0, torch.bitwise_left_shift(torch.ones_like(xs), 64 - ys) - 1, -1)
        return torch.bitwise_and(out, keep).view(dtype)
    xs, ys = x.to(torch.int64), y.to(torch.int64)
    if direction == "LEFT":
        out = torch.bitwise_and(torch.bitwise_left_shift(xs, ys), (1 << bits) - 1)
    else:
        out = torch.bitwise_right_shift(xs, ys)
    return out.to(dtype)


@register("IsInf")
def is_inf(x: torch.Tensor, detect_negative: int = 1, detect_positive: int = 1) -> torch.Tensor:
    if detect_negative and detect_positive:
        return torch.isinf(x)
    if detect_positive:
        return torch.isposinf(x)
    if detect_negative:
        return torch.isneginf(x)
    return torch.zeros_like(x, dtype=torch.bool)


@register("Clip", aliases=SAME)
def clip(x: torch.Tensor, min=None, max=None) -> torch.Tensor:
    # `min`/`max` are optional tensor inputs (opset >= 11) or float attributes (opset < 11).
    if min is None and max is None:
        return x
    return torch.clamp(x, min, max)


def _fold(fn, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = fn(out, x)
    return out


@register("Max", aliases=LONE_INPUT)
def max_(*xs: torch.Tensor) -> torch.Tensor:
    return _fold(_maximum, xs)


@register("Min", aliases=LONE_INPUT)
def min_(*xs: torch.Tensor) -> torch.Tensor:
    return _fold(_minimum, xs)


@register("Sum", aliases=LONE_INPUT)
def sum_(*xs: torch.Tensor) -> torch.Tensor:
    return _fold(add, xs)


@register("Mean", aliases=LONE_INPUT)
def mean(*xs: torch.Tensor) -> torch.Tensor:
    return _fold(torch.add, xs) / len(xs) if len(xs) > 1 else xs[0]

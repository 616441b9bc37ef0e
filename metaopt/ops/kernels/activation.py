"""Activations with parameters, and the softmax family.

Softmax, LogSoftmax and Hardmax implement opset >= 13 semantics (normalize along `axis`).
Before opset 13 they flattened the input to 2-D at `axis` and normalized the whole trailing
block; a kernel cannot see the opset, so an importer reading such a model must rewrite
those nodes (Flatten -> op(axis=-1) -> Reshape) or refuse them.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
import torch.nn.functional as F

from metaopt.ops import onnx_bodies, patterns
from metaopt.ops.kernels.attention import fuse_attention
from metaopt.ops.registry import register

# ONNX's Selu defaults are the float32 roundings of torch's constants.
_SELU_ALPHA = 1.67326319217681884765625
_SELU_GAMMA = 1.05070102214813232421875

register("Softsign")(F.softsign)
register("Mish")(F.mish)
register("HardSwish")(F.hardswish)


@register("LeakyRelu")
def leaky_relu(X: torch.Tensor, alpha: float = 0.01) -> torch.Tensor:
    return F.leaky_relu(X, alpha)


@register("Elu")
def elu(X: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return F.elu(X, alpha)


@register("Celu")
def celu(X: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return F.celu(X, alpha)


@register("Selu")
def selu(X: torch.Tensor, alpha: float = _SELU_ALPHA, gamma: float = _SELU_GAMMA) -> torch.Tensor:
    if alpha == _SELU_ALPHA and gamma == _SELU_GAMMA:
        return F.selu(X)
    return gamma * torch.where(X > 0, X, alpha * torch.expm1(X))


def is_torch_hardsigmoid(alpha: float, beta: float) -> bool:
    """Is this ONNX HardSigmoid torch's nn.Hardsigmoid (relu6(x + 3) / 6)? Its alpha arrives as
    float32(1/6), 0.16666667: computed as written, a float64 model would be 3e-8 off torch."""
    return beta == 0.5 and struct.unpack("f", struct.pack("f", alpha))[0] == _SIXTH32


_SIXTH32 = struct.unpack("f", struct.pack("f", 1 / 6))[0]


@register("HardSigmoid")
def hard_sigmoid(X: torch.Tensor, alpha: float = 0.2, beta: float = 0.5) -> torch.Tensor:
    if is_torch_hardsigmoid(alpha, beta):
        return F.hardsigmoid(X)
    return torch.clamp(X * alpha + beta, 0.0, 1.0)


@register("Softplus", amp="black")
def softplus(X: torch.Tensor) -> torch.Tensor:
    return F.softplus(X)


@register("Gelu")
def gelu(X: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """ONNX opset-20 Gelu (torch's nn.GELU / F.gelu export as this op directly); the exported
    elementwise chains of the tanh and erf GELU fuse into it (the Tanh and Erf rows' `fuse`)."""
    return F.gelu(X, approximate=approximate)


# The tanh GELU's argument is c*(x + k*x**3), the erf GELU's x/sqrt(2); both end in 0.5*x*(1 + f).
_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_K = 0.044715


def fuse_tanh_gelu(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """Tanh's `fuse` rule: ``0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3)))`` (HF's gelu_new,
    GPT-2's NewGELUActivation, gelu_fast, BLOOM's bias GELU: any association order and spelling
    of x**3) is ``Gelu(x, approximate="tanh")``."""
    return _fuse_gelu(q, i, producer, consumers, {1: _TANH_C, 3: _TANH_C * _TANH_K}, "tanh")


def fuse_erf_gelu(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """Erf's `fuse` rule: ``0.5*x*(1 + erf(x/sqrt(2)))`` (HF's gelu_python) is ``Gelu(x)``."""
    return _fuse_gelu(q, i, producer, consumers, {1: 1.0 / math.sqrt(2.0)}, "none")


def _fuse_gelu(q, i, producer, consumers, inner: dict[int, float], approximate: str):
    """The anchor op `i` (Tanh / Erf) applied to the polynomial `inner` (degree -> coefficient)
    of one value x, inside 0.5*x*(1 + anchor): (absorbed ops, the Gelu op) or None. Every
    intermediate value must have one reader (patterns.polynomial walks only such values)."""
    from metaopt.ir import Op

    anchor = q.ops[i]
    arg = patterns.polynomial(q, anchor.inputs[0], i, producer, consumers)
    if arg is None or len(arg.atoms()) != 1:
        return None
    (x,) = arg.atoms()
    if not patterns.close(arg.poly, {patterns.term((x, n)): c for n, c in inner.items()}):
        return None
    out = _gelu_output(q, anchor.outputs[0], x, producer, consumers)
    if out is None:
        return None
    final, chain = out
    xv, yv = q.vars[x], q.vars[final]
    if xv.dtype not in patterns.FLOAT_DTYPES or (xv.dtype, xv.shape) != (yv.dtype, yv.shape):
        return None  # a constant broadcast the value to another shape, or cast it
    fused = Op(
        "Gelu",
        [x],
        [final],
        {"approximate": approximate},
        role=anchor.role,
        scope=q.ops[producer[final]].scope,
    )
    return sorted((arg.ops | chain.ops) - {i}), fused


def _gelu_output(q, t: str, x: str, producer, consumers, steps: int = 4):
    """Follow the anchor's output `t` through its lone readers to the value 0.5*x*(1 + t):
    (that value's name, the chain computing it from x and t) or None."""
    want = {patterns.term((x, 1)): 0.5, patterns.term((x, 1), (t, 1)): 0.5}
    name = t
    for _ in range(steps):
        readers = consumers.get(name, [])
        if len(readers) != 1 or q.ops[readers[0]].type not in patterns.ARITHMETIC:
            return None
        name = q.ops[readers[0]].outputs[0]
        chain = patterns.polynomial(q, name, None, producer, consumers)
        if chain is not None and patterns.close(chain.poly, want):
            return name, chain
    return None


@register("ThresholdedRelu")
def thresholded_relu(X: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return torch.where(X > alpha, X, torch.zeros((), dtype=X.dtype, device=X.device))


@register("Shrink")
def shrink(input: torch.Tensor, bias: float = 0.0, lambd: float = 0.5) -> torch.Tensor:
    zero = torch.zeros((), dtype=input.dtype, device=input.device)
    if not input.is_floating_point():
        bias = int(bias)
    out = torch.where(input < -lambd, input + bias, torch.where(input > lambd, input - bias, zero))
    return out.to(input.dtype)


@register("PRelu")
def prelu(X: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    # ONNX's slope broadcasts against X in general, F.prelu only takes per-channel slopes.
    return torch.where(X < 0, X * slope, X)


@register("Swish")
def swish(X: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    if alpha == 1.0:
        return F.silu(X)
    return X * torch.sigmoid(alpha * X)


# fuse: the exporter's decomposed attention around it -> ScaledDotProductAttention (attention.py)
@register("Softmax", amp="black", fuse=fuse_attention, min_opset=13)
def softmax(input: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.softmax(input, axis)


@register("LogSoftmax", amp="black", min_opset=13)
def log_softmax(input: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.log_softmax(input, axis)


@register("Hardmax", min_opset=13)
def hardmax(input: torch.Tensor, axis: int = -1) -> torch.Tensor:
    # argmax picks the first maximum, as ONNX requires on ties.
    idx = torch.argmax(input, axis, keepdim=True)
    return torch.zeros_like(input).scatter_(axis, idx, 1)


@register("SwiGLU")
def swiglu(A: torch.Tensor, B: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    gate = F.silu(A) if alpha == 1.0 else A * torch.sigmoid(alpha * A)
    return gate * B


@register("Silu", domain="metaopt", onnx_function=onnx_bodies.silu)
def silu(X: torch.Tensor) -> torch.Tensor:
    """``X * sigmoid(X)`` (nn.SiLU, which torch exports as Sigmoid and Mul): one kernel, and a
    grad (SiluGrad) that reads X alone where the pair's reads X and sigmoid(X)."""
    return F.silu(X)


@register("QuickGelu", domain="metaopt", onnx_function=onnx_bodies.quick_gelu)
def quick_gelu(X: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    """``X * sigmoid(alpha * X)``: CLIP's QuickGELU (alpha 1.702; ONNX Runtime's contrib op of
    the same name and attribute, ONNX's Swish). Its grad (QuickGeluGrad) reads X alone; the
    exported chain's holds alpha * X and the sigmoid too."""
    return X * torch.sigmoid(X * alpha)


@register("SiluMul", domain="metaopt", onnx_function=onnx_bodies.silu_mul)
def silu_mul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``silu(A) * B``: the SiLU-gated MLP's gate (LLaMA's, Mistral's, Qwen's SwiGLU:
    ``down(silu(gate(x)) * up(x))``); ONNX's SwiGLU with alpha 1. Its grad reads A and B only:
    the exported chain's holds sigmoid(A) and silu(A) too, two FFN-wide values per layer."""
    return F.silu(A) * B


def fuse_silu(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """Sigmoid's `fuse` rule: ``Mul(a, Sigmoid(a))`` is ``Silu(a)``, and ``Mul(Silu(a), b)``
    with b of a's shape and dtype (the gated MLP's up projection) is ``SiluMul(a, b)``;
    ``Mul(a, Sigmoid(Mul(a, c)))`` with a scalar constant c is ``QuickGelu(a, alpha=c)``. The
    sigmoid, the SiLU and the scaled input must have no other reader."""
    from metaopt.ir import Op

    sig = q.ops[i]
    a, s = sig.inputs[0], sig.outputs[0]
    quick = _quick_gelu(q, i, producer, consumers)
    if quick is not None:
        return quick
    k = patterns.one_reader(consumers, s)
    if k is None or q.ops[k].type != "Mul" or sorted(q.ops[k].inputs) != sorted([a, s]):
        return None
    h = q.ops[k].outputs[0]
    av = q.vars[a]
    if av.dtype not in patterns.FLOAT_DTYPES or (av.dtype, av.shape) != (q.vars[h].dtype, q.vars[h].shape):
        return None
    j = patterns.one_reader(consumers, h)
    gate = j is not None and q.ops[j].type == "Mul"
    b = next((x for x in q.ops[j].inputs if x != h), None) if gate else None
    if b is not None and (q.vars[b].dtype, q.vars[b].shape) == (av.dtype, av.shape):
        y = q.ops[j].outputs[0]
        if (q.vars[y].dtype, q.vars[y].shape) == (av.dtype, av.shape):
            return [k, j], Op("SiluMul", [a, b], [y], {}, role=sig.role, scope=q.ops[j].scope)
    return [k], Op("Silu", [a], [h], {}, role=sig.role, scope=q.ops[k].scope)


def _quick_gelu(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """``Mul(a, Sigmoid(Mul(a, c)))`` (either operand order) -> ``QuickGelu(a, alpha=c)``, or None."""
    from metaopt.ir import Op

    sig = q.ops[i]
    m = producer.get(sig.inputs[0])
    if m is None or q.ops[m].type != "Mul" or patterns.one_reader(consumers, sig.inputs[0]) != i:
        return None
    x, y = q.ops[m].inputs
    alpha, a = (patterns.scalar_constant(q, y), x)
    if alpha is None:
        alpha, a = (patterns.scalar_constant(q, x), y)
    k = patterns.one_reader(consumers, sig.outputs[0])
    if alpha is None or k is None or q.ops[k].type != "Mul":
        return None
    if sorted(q.ops[k].inputs) != sorted([a, sig.outputs[0]]):
        return None
    h = q.ops[k].outputs[0]
    av = q.vars[a]
    if av.dtype not in patterns.FLOAT_DTYPES or (av.dtype, av.shape) != (q.vars[h].dtype, q.vars[h].shape):
        return None
    return [m, k], Op("QuickGelu", [a], [h], {"alpha": alpha}, role=sig.role, scope=q.ops[k].scope)

"""Activations with parameters, and the softmax family.

Softmax, LogSoftmax and Hardmax implement opset >= 13 semantics (normalize along `axis`).
Before opset 13 they flattened the input to 2-D at `axis` and normalized the whole trailing
block; a kernel cannot see the opset, so an importer reading such a model must rewrite
those nodes (Flatten -> op(axis=-1) -> Reshape) or refuse them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


@register("HardSigmoid")
def hard_sigmoid(X: torch.Tensor, alpha: float = 0.2, beta: float = 0.5) -> torch.Tensor:
    return torch.clamp(X * alpha + beta, 0.0, 1.0)


@register("Softplus", amp="black")
def softplus(X: torch.Tensor) -> torch.Tensor:
    return F.softplus(X)


@register("Gelu")
def gelu(X: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(X, approximate=approximate)


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


@register("Softmax", amp="black")
def softmax(input: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.softmax(input, axis)


@register("LogSoftmax", amp="black")
def log_softmax(input: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.log_softmax(input, axis)


@register("Hardmax")
def hardmax(input: torch.Tensor, axis: int = -1) -> torch.Tensor:
    # argmax picks the first maximum, as ONNX requires on ties.
    idx = torch.argmax(input, axis, keepdim=True)
    return torch.zeros_like(input).scatter_(axis, idx, 1)


@register("SwiGLU")
def swiglu(A: torch.Tensor, B: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    gate = F.silu(A) if alpha == 1.0 else A * torch.sigmoid(alpha * A)
    return gate * B

"""Normalizations: batch (ONNX and torch training semantics), layer, group, instance, RMS, Lp, LRN."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from metaopt.ops import onnx_bodies, patterns
from metaopt.ops.registry import register


def _pad_outputs(outs: tuple, nout: int):
    """The first `nout` outputs, None for any the op does not produce."""
    if nout == 1:
        return outs[0]
    return outs[:nout] + (None,) * (nout - len(outs))


def _onnx_bn_for_test(op):  # noqa: ANN001, ANN202
    """Evaluation: ONNX's inference mode (running stats, no new ones)."""
    attrs = {k: v for k, v in op.attrs.items() if k != "training_mode"}
    return dataclasses.replace(op, outputs=op.outputs[:1], attrs=attrs)


@register(
    "BatchNormalization", needs_outputs=True, train_repair="batch_norm_training", for_test=_onnx_bn_for_test
)
def batch_normalization(
    X: torch.Tensor,
    scale: torch.Tensor,
    B: torch.Tensor,
    input_mean: torch.Tensor,
    input_var: torch.Tensor,
    epsilon: float = 1e-5,
    momentum: float = 0.9,
    training_mode: int = 0,
    spatial: int = 1,
    _nout: int = 1,
):
    if not training_mode:
        return _pad_outputs((F.batch_norm(X, input_mean, input_var, scale, B, False, 0.0, epsilon),), _nout)
    # ONNX training mode: normalize with the batch statistics and blend them into the running
    # ones with ONNX's momentum (weight of the old value) and the *population* variance.
    y = torch.native_batch_norm(X, scale, B, None, None, True, 0.0, epsilon)[0]
    if _nout == 1:
        return y
    dims = (0, *range(2, X.dim()))
    var, mean = torch.var_mean(X, dims, correction=0)
    running_mean = input_mean * momentum + mean * (1 - momentum)
    running_var = input_var * momentum + var * (1 - momentum)
    return _pad_outputs((y, running_mean, running_var), _nout)


def _bn_training_for_test(op):  # noqa: ANN001, ANN202
    """Evaluation: ONNX BatchNormalization on the running stats, as `metaopt.export(model.eval())`
    gives it (ONNX's momentum weighs the old value, torch's the new statistic)."""
    attrs = {"momentum": 1.0 - op.attrs.get("momentum", 0.1), "epsilon": op.attrs.get("epsilon", 1e-5)}
    return dataclasses.replace(op, type="BatchNormalization", outputs=op.outputs[:1], attrs=attrs)


@register(
    "BatchNormTraining",
    for_test=_bn_training_for_test,
    domain="metaopt",
    needs_outputs=True,
    amp_float32_inputs=(1, 2, 3, 4),  # scale, bias, running mean and var
    amp_float32_outputs=(1, 2, 3, 4),  # new running stats, saved mean and inverse std
    recompute_holds=(3, 4),  # saved mean and inverse std: C floats each
    onnx_function=onnx_bodies.batch_norm_training,
)
def batch_norm_training(
    X: torch.Tensor,
    scale: torch.Tensor | None,
    B: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    epsilon: float = 1e-5,
    momentum: float = 0.1,
    _nout: int = 3,
):
    """torch's training-mode batch norm, out of place: (Y, new running mean, new running var).

    torch blends with momentum as the weight of the *new* statistic and the *unbiased*
    variance; updating fresh clones through torch's own op keeps it bitwise torch's.
    """
    rm = running_mean.clone() if running_mean is not None else None
    rv = running_var.clone() if running_var is not None else None
    # native_batch_norm is what F.batch_norm runs on CPU (bitwise equal, tested), and it
    # also hands back the batch mean and inverse std the backward reads (outputs 4, 5).
    y, save_mean, save_invstd = torch.native_batch_norm(X, scale, B, rm, rv, True, momentum, epsilon)
    return _pad_outputs((y, rm, rv, save_mean, save_invstd), _nout)


def mixed_layer_norm(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Can torch's layer norm kernels take `x` and `scale` as they are? AMP keeps LayerNorm's
    input low and its scale float32 (Paddle's rule). The CPU kernels take that mix (computing in
    float32, rounding the output); the CUDA ones refuse it, so there the op runs on x upcast
    to float32, the same arithmetic, and rounds its output back to x's dtype. (LayerNormGrad
    upcasts on every device: see grad.layer_norm_grad.)"""
    return x.dtype == scale.dtype or x.device.type == "cpu"


@register(
    "LayerNormalization",
    needs_outputs=True,
    amp_float32_inputs=(1, 2),  # scale, bias
    amp_float32_outputs=(1, 2),  # saved mean and inverse std
)
def layer_normalization(
    X: torch.Tensor,
    Scale: torch.Tensor,
    B: torch.Tensor | None = None,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
    _nout: int = 1,
):
    shape = X.shape[axis:]
    if not mixed_layer_norm(X, Scale):  # AMP's low X with float32 Scale where no kernel mixes them
        y, mean, rstd = layer_normalization(X.to(Scale.dtype), Scale, B, axis, epsilon, stash_type, 3)
        return _pad_outputs((y.to(X.dtype), mean, rstd), _nout) if _nout > 1 else y.to(X.dtype)
    if Scale.shape == shape and (B is None or B.shape == shape):
        # native_layer_norm is what F.layer_norm runs: bitwise torch, and Mean/InvStdDev for free.
        y, mean, rstd = torch.native_layer_norm(X, shape, Scale, B, epsilon)
    else:  # Scale/B that only broadcast to the normalized shape
        y, mean, rstd = torch.native_layer_norm(X, shape, None, None, epsilon)
        y = y * Scale if B is None else torch.addcmul(B, y, Scale)
    if _nout == 1:
        return y
    return _pad_outputs((y, mean, rstd), _nout)


@register("GroupNormalization", amp="black")
def group_normalization(
    X: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    epsilon: float = 1e-5,
    num_groups: int = 1,
    stash_type: int = 1,
) -> torch.Tensor:
    c = X.shape[1]
    if scale.numel() != c:
        # Opset 18 had one scale/bias per group; opset 21 made them per channel.
        scale = scale.repeat_interleave(c // num_groups)
        bias = bias.repeat_interleave(c // num_groups)
    return F.group_norm(X, num_groups, scale, bias, epsilon)


@register("InstanceNormalization", amp="black")
def instance_normalization(
    input: torch.Tensor, scale: torch.Tensor, B: torch.Tensor, epsilon: float = 1e-5
) -> torch.Tensor:
    return F.instance_norm(input, None, None, scale, B, True, 0.0, epsilon)


@register("RMSNormalization", amp="black")
def rms_normalization(
    X: torch.Tensor, scale: torch.Tensor, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1
) -> torch.Tensor:
    shape = X.shape[axis:]
    if scale.shape == shape:
        return F.rms_norm(X, shape, scale, epsilon)
    return F.rms_norm(X, shape, None, epsilon) * scale


@register("LpNormalization", amp="black")
def lp_normalization(input: torch.Tensor, axis: int = -1, p: int = 2) -> torch.Tensor:
    norm = torch.linalg.vector_norm(input, p, dim=axis, keepdim=True)
    return torch.where(norm == 0, 0.0, input / norm).to(input.dtype)  # ONNX: 0 / 0 -> 0


@register("MeanVarianceNormalization", amp="black")
def mean_variance_normalization(X: torch.Tensor, axes: list[int] | None = None) -> torch.Tensor:
    dims = tuple(axes) if axes is not None else (0, 2, 3)
    var, mean = torch.var_mean(X, dims, correction=0, keepdim=True)
    return (X - mean) / (torch.sqrt(var) + 1e-9)


@register("LRN")
def lrn(
    X: torch.Tensor, size: int, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0
) -> torch.Tensor:
    return F.local_response_norm(X, size, alpha, beta, bias)


@register("RMSNorm", domain="metaopt", amp="black", onnx_function=onnx_bodies.rms_norm)
def rms_norm(X: torch.Tensor, scale: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """``scale * X / sqrt(mean(X**2, -1) + epsilon)`` over the last dim: HF's LlamaRMSNorm /
    T5LayerNorm, which torch exports as seven ops (ReduceMean's `fuse` folds them into this).
    One pass (torch's fused rms_norm; bit for bit the eager module's rsqrt form); its grad
    (RMSNormGrad) reads X and scale only, where the chain's holds X / rms as well."""
    return F.rms_norm(X, X.shape[-1:], scale, epsilon)


def fuse_rms_norm(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """ReduceMean's `fuse` rule: ``w * (x * 1/sqrt(ReduceMean(x**2, [-1]) + eps))`` is
    ``RMSNorm(x, w, epsilon=eps)``: x**2 as Pow(x, 2) or Mul(x, x), x * 1/sqrt as
    Mul(x, Reciprocal(Sqrt)) (torch.rsqrt's export), Mul(x, Div(1, Sqrt)) or Div(x, Sqrt), either
    operand order of every Mul; w of shape [H] (a param, or computed:
    Gemma's 1 + w). Every intermediate value must have one reader. A chain with casts (a half
    model's float32 upcast) or no scale stays as exported."""
    from metaopt.ir import Op

    mean = q.ops[i]
    j = producer.get(mean.inputs[0])
    x = _square_of(q, q.ops[j]) if j is not None and consumers.get(mean.inputs[0]) == [i] else None
    if x is None or q.vars[x].dtype not in patterns.FLOAT_DTYPES or not _last_axis(q, mean, x):
        return None
    chain = [j]
    add = _lone_reader(q, mean.outputs[0], consumers, ("Add",))
    eps = _other_scalar(q, add, mean.outputs[0])
    sqrt = _lone_reader(q, q.ops[add].outputs[0], consumers, ("Sqrt",)) if eps is not None else None
    divide = _divide_by(q, x, sqrt, consumers) if sqrt is not None else None
    if divide is None:
        return None
    n = q.ops[divide[-1]].outputs[0]
    scaled = _lone_reader(q, n, consumers, ("Mul",))
    w = next((y for y in q.ops[scaled].inputs if y != n), None) if scaled is not None else None
    xv = q.vars[x]
    if w is None or xv.shape is None or q.vars[w].shape != tuple(xv.shape[-1:]):
        return None
    y = q.ops[scaled].outputs[0]
    if (q.vars[y].dtype, q.vars[y].shape, q.vars[w].dtype) != (xv.dtype, xv.shape, xv.dtype):
        return None
    fused = Op("RMSNorm", [x, w], [y], {"epsilon": eps}, role=mean.role, scope=mean.scope)
    return [*chain, add, sqrt, *divide, scaled], fused


def _lone_reader(q, name: str, consumers, op_types: tuple[str, ...]) -> int | None:
    """The index of the only reader of `name` when it is one of `op_types`, else None."""
    k = patterns.one_reader(consumers, name)
    return k if k is not None and q.ops[k].type in op_types else None


def _square_of(q, op) -> str | None:
    """x when `op` is Pow(x, 2) or Mul(x, x)."""
    if len(op.outputs) != 1:
        return None
    if op.type == "Mul" and op.inputs[0] == op.inputs[1]:
        return op.inputs[0]
    if op.type == "Pow" and patterns.scalar_constant(q, op.inputs[1]) == 2.0:
        return op.inputs[0]
    return None


def _last_axis(q, mean, x: str) -> bool:
    """Does ReduceMean `mean` average over x's last dim only, keeping it?"""
    if not mean.attrs.get("keepdims", 1):
        return False
    axes = mean.attrs.get("axes")
    if len(mean.inputs) > 1 and mean.inputs[1]:
        t = q.values.get(mean.inputs[1])
        axes = t.tolist() if t is not None and q.vars[mean.inputs[1]].kind == "constant" else None
    rank = len(q.vars[x].shape or ())
    return rank > 0 and axes is not None and [a % rank for a in axes] == [rank - 1]


def _other_scalar(q, add: int | None, name: str) -> float | None:
    """The positive scalar constant (an epsilon) op `add` adds to `name`, else None."""
    if add is None:
        return None
    other = [y for y in q.ops[add].inputs if y != name]
    c = patterns.scalar_constant(q, other[0]) if len(other) == 1 else None
    return c if c is not None and c > 0 else None


def _divide_by(q, x: str, sqrt: int, consumers) -> list[int] | None:
    """The ops taking x / `sqrt`'s output: Mul(x, Reciprocal(s)), Mul(x, Div(1, s)) or
    Div(x, s), each value read once; None for anything else."""
    s = q.ops[sqrt].outputs[0]
    k = _lone_reader(q, s, consumers, ("Reciprocal", "Div"))
    if k is None:
        return None
    op = q.ops[k]
    if op.type == "Div" and op.inputs == [x, s]:
        return [k]
    if op.type == "Div" and (op.inputs[1] != s or patterns.scalar_constant(q, op.inputs[0]) != 1.0):
        return None
    m = _lone_reader(q, op.outputs[0], consumers, ("Mul",))
    if m is None or sorted(q.ops[m].inputs) != sorted([x, op.outputs[0]]):
        return None
    return [k, m]

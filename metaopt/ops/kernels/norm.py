"""Normalizations: batch (ONNX and torch training semantics), layer, group, instance, RMS, Lp, LRN."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metaopt.ops.registry import register


def _pad_outputs(outs: tuple, nout: int):
    """The first `nout` outputs, None for any the op does not produce."""
    if nout == 1:
        return outs[0]
    return outs[:nout] + (None,) * (nout - len(outs))


@register("BatchNormalization", needs_outputs=True, train_repair="batch_norm_training")
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


@register(
    "BatchNormTraining",
    domain="metaopt",
    needs_outputs=True,
    amp_float32_inputs=(1, 2, 3, 4),  # scale, bias, running mean and var
    amp_float32_outputs=(1, 2, 3, 4),  # new running stats, saved mean and inverse std
    recompute_holds=(3, 4),  # saved mean and inverse std: C floats each
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

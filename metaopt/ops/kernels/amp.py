"""Ops of automatic mixed precision's dynamic loss scaling (passes/amp.py, fleet/steps.py).

``CheckFiniteAndUnscale`` is Paddle's ``check_finite_and_unscale`` (torch:
``GradScaler.unscale_``): every grad times ``1 / loss_scaling`` and one flag saying
whether any of them holds an inf or a nan. ``UpdateLossScaling`` is Paddle's
``update_loss_scaling`` rule, operation for operation (Fleet's ``amp_configs``):

* a step with inf/nan grads resets the good-step counter and counts a bad step; after
  ``decr_every_n_nan_or_inf`` bad steps in a row the scale is multiplied by
  ``decr_ratio`` (never below 1) and the bad counter restarts;
* a finite step resets the bad counter and counts a good step; after
  ``incr_every_n_steps`` good steps in a row the scale is multiplied by ``incr_ratio``
  (kept as it was if that is not finite) and the good counter restarts.

Both compute on the device without a host read (``torch.where``); the update ops
read ``found_inf`` on the host to skip the step (see ops/kernels/optim.py), as
``GradScaler.step`` reads its ``found_inf`` before calling ``optimizer.step``.
"""

from __future__ import annotations

import torch

from metaopt.ir.dtypes import torch_dtype_from_onnx
from metaopt.ops.registry import register


@register(
    "CheckFiniteAndUnscale", domain="metaopt", needs_outputs=True, recomputable=False, fresh_outputs=True
)
def check_finite_and_unscale(*inputs: torch.Tensor, to: int | None = None, _nout: int = 2):
    """``(*grads, loss_scaling) -> (*grads / loss_scaling, found_inf)``.

    The grads are multiplied by ``inv = float32(1 / float64(scale))``, the reciprocal
    torch's GradScaler forms (exact for the power-of-two scales of the defaults), into
    new tensors (the scaled grads are left as they were: they may be fetched). `to`
    (an ONNX element type) casts the unscaled grads, e.g. half grads to the float32
    of their master weights (AMP O2). ``found_inf`` is a float32 scalar, 1.0 when any
    unscaled grad holds an inf or a nan (the max-abs of each grad, which a nan
    propagates through and a finite grad never overflows), else 0.0 — torch's
    ``found_inf`` convention: a number, so that workers can sum it (an all-reduce) and
    all skip a step any of them overflowed on. Its readers take nonzero as true.
    """
    *grads, scale = inputs
    if len(grads) + 1 != _nout or not grads:
        raise ValueError(
            f"CheckFiniteAndUnscale: {len(grads)} grads in but {_nout} outputs (the grads and found_inf)"
        )
    inv = scale.double().reciprocal().float()
    if to is not None:
        dtype = torch_dtype_from_onnx(to, what="CheckFiniteAndUnscale")
        grads = [g.to(dtype) for g in grads]
    outs = torch._foreach_mul(list(grads), inv)
    # (a 0-dim half grad times the 0-dim float inv would promote: keep each grad's dtype)
    outs = [o if o.dtype == g.dtype else o.to(g.dtype) for o, g in zip(outs, grads, strict=True)]
    peaks = torch._foreach_norm(outs, float("inf"))
    found_inf = torch.logical_not(torch.isfinite(torch.stack(peaks).float()).all()).float()
    return (*outs, found_inf)


@register("UpdateLossScaling", domain="metaopt", needs_outputs=True, recomputable=False)
def update_loss_scaling(
    found_inf: torch.Tensor,
    loss_scaling: torch.Tensor,
    good_steps: torch.Tensor,
    bad_steps: torch.Tensor,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    _nout: int = 3,
):
    """``(found_inf, scale, good, bad) -> (new scale, new good, new bad)``: Fleet's rule (module doc).

    `found_inf` (bool or a number; nonzero = an overflow) may be a sum over workers."""
    found = found_inf.to(torch.bool)
    zero = torch.zeros_like(good_steps)
    good = torch.where(found, zero, good_steps + 1)
    bad = torch.where(found, bad_steps + 1, zero)
    grow = good >= incr_every_n_steps  # only ever true on a finite step (good was reset otherwise)
    shrink = bad >= decr_every_n_nan_or_inf
    up = loss_scaling * incr_ratio
    up = torch.where(torch.isfinite(up), up, loss_scaling)
    down = torch.clamp(loss_scaling * decr_ratio, min=1.0)
    new_scale = torch.where(grow, up, torch.where(shrink, down, loss_scaling))
    return new_scale, torch.where(grow, zero, good), torch.where(shrink, zero, bad)


# --- the device check ------------------------------------------------------------------------

# CUDA compute capability each low dtype needs: half arithmetic came with sm_53, bfloat16
# with Ampere (sm_80; torch emulates it more slowly on older GPUs: refused, not slowed down).
CUDA_CAPABILITY = {"float16": (5, 3), "bfloat16": (8, 0)}
_SUPPORTED: set[tuple[str, str]] = set()


class AmpDeviceError(RuntimeError):
    pass


def check_amp_device(dtype: str, device: torch.device) -> None:
    """Raise AmpDeviceError naming `device` if it cannot run AMP in `dtype` (cached per device)."""
    key = (str(device), dtype)
    if key in _SUPPORTED:
        return
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        need = CUDA_CAPABILITY[dtype]
        if tuple(cap) < need:
            name = torch.cuda.get_device_name(device)
            other = [d for d, c in CUDA_CAPABILITY.items() if tuple(cap) >= c]
            hint = f"use amp_configs['dtype']={other[0]!r}" if other else "turn strategy.amp off"
            raise AmpDeviceError(
                f"amp_configs['dtype']={dtype!r}: {device} ({name}, compute capability "
                f"{cap[0]}.{cap[1]}) has no {dtype} support (needs {need[0]}.{need[1]} or newer); {hint}"
            )
    else:
        dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        try:  # the kernels AMP leans on: matmul, layer norm on mixed inputs, softmax
            a = torch.ones(2, 2, dtype=dt, device=device)
            torch.nn.functional.linear(a, a, a[0])
            torch.native_layer_norm(a, (2,), torch.ones(2, device=device), None, 1e-5)
            torch.softmax(a.float(), -1)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            raise AmpDeviceError(
                f"amp_configs['dtype']={dtype!r}: this torch build has no {dtype} kernels on {device} "
                f"({str(e).splitlines()[0]})"
            ) from e
    _SUPPORTED.add(key)


@register("CheckAmpDevice", domain="metaopt", needs_device=True, host_outputs=True, recomputable=False)
def check_amp_device_op(*, dtype: str, _device: torch.device) -> torch.Tensor:
    """Refuses, before the first low-precision op runs, a device that cannot run `dtype`
    (the executor's device is only known when the program runs). No inputs; its output
    (true, a host value nothing reads) is there because an ONNX node needs one."""
    check_amp_device(dtype, _device)
    return torch.tensor(True)

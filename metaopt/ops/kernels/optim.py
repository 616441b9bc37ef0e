"""Optimizer update ops: step counter, learning-rate schedules, global-norm clipping, updates.

The update kernels write the param and its state IN PLACE (their rows declare it in
``inplace``; the executor checks that nothing reads the old values afterwards), as
torch.optim does: allocating a fresh copy of every large param and moment each step
cost the training step ~1.5x on CPU (first-touch page faults). They run the same
sequence of torch ops as ``torch/optim/sgd.py::_single_tensor_sgd`` /
``adam.py::_single_tensor_adam``, with the same Python-float hyper-parameter
arithmetic, so they are bitwise equal to torch.optim on CPU. The grad is never written.

Host reads. The learning rate (a float64 scalar var) and the step counter (an int64
scalar var) are read as Python numbers with ``.item()``, exactly as torch does
(``_get_value(step_t)``, ``lr`` a Python float): bias corrections ``1 - beta ** step``
and ``lr / bias_correction1`` are double-precision Python arithmetic in torch, and a
float32 tensor computation would differ from it in the last bit. These inputs are listed
in the rows' ``host_inputs``. The learning rate is float64 for the same reason: torch's
``lr`` is a Python (double) float, and ``float32(lr) / bc1`` rounds differently from
``lr / bc1`` in ~3% of Adam steps.

Input order of the update ops: ``(param, grad, lr[, step], *state[, found_inf])``; outputs:
``(new param, *new state)`` in the state's order.

Skipped steps (AMP's dynamic loss scaling). ``StepCounter`` and every update op take an
optional trailing ``found_inf`` input (a scalar, nonzero = skip; at the index the row's
``skip_input`` gives, `registry.skip_input(op_type)`). When it is true the step is skipped entirely, as
``torch.amp.GradScaler.step`` skips ``optimizer.step()``: the param, every state var
and the step counter keep their values (the update kernels return their inputs
untouched). It is read on the host (``.item()``), like the learning rate.

Off the CPU (CUDA, and the meta device that proves it: runtime/hostsync.py) a host read waits
for the device and breaks CUDA-graph capture, so there every kernel takes its device form,
which reads nothing on the host: the updates are torch's fused kernels with a tensor learning
rate, the step as a device tensor and ``found_inf`` handed to the kernel, which skips the
update itself (what ``torch.optim.Adam(fused=True)`` / ``SGD(fused=True)`` run, and bitwise
equal to them: tests/ops/test_optim_device_forms.py); the schedules are the same float64
arithmetic as tensor ops. On the CPU reading a CPU tensor costs nothing, and the host forms
stay bitwise equal to torch.optim's defaults.
"""

from __future__ import annotations

from typing import Any

import torch

from metaopt.ops.registry import register

# --- step counter and learning-rate schedules ----------------------------------------


def _skip(found_inf: torch.Tensor | None) -> bool:
    return found_inf is not None and bool(found_inf.item())  # host read, as torch's GradScaler.step


def _on_host(t: torch.Tensor) -> bool:
    """Whether `t` (the param an update writes, the step a schedule reads) lives on the CPU,
    where reading a value costs nothing: the host forms; else the device forms."""
    return t.device.type == "cpu"


def _lr_arg(lr: torch.Tensor, param: torch.Tensor) -> torch.Tensor | float:
    """The learning rate as a fused kernel takes it: the device tensor itself, or, where the
    plan hands over a host copy (a constant read at a host input), its value (free to read)."""
    return float(lr) if lr.device != param.device and lr.device.type == "cpu" else lr


def _flag(found_inf: torch.Tensor | None) -> torch.Tensor | None:
    """found_inf as the fused kernels read it: they skip on exactly 1.0, ours may be a sum."""
    return None if found_inf is None else (found_inf != 0).to(torch.float32)


@register("StepCounter", domain="metaopt", recomputable=False, skip_input=1)
def step_counter(step: torch.Tensor, found_inf: torch.Tensor | None = None) -> torch.Tensor:
    """``step + 1``: the 1-based number of the update being made (torch's ``state["step"]``);
    ``step`` itself when `found_inf` is true (a skipped update is not counted)."""
    if found_inf is None:
        return step + 1
    return step + (found_inf == 0).to(step.dtype)  # no host read


def linear_warmup_decay_factor(step: int, warmup_steps: int, total_steps: int, end_ratio: float) -> float:
    """The multiplier of the peak rate at 0-based update index `step` (LambdaLR's ``lr_lambda``).

    ``step / max(1, warmup)`` during warmup, then a straight line from 1 down to
    ``end_ratio`` at `total_steps`, ``end_ratio`` after it. With ``end_ratio == 0`` this
    is, operation for operation, transformers' ``get_linear_schedule_with_warmup`` lambda.
    """
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    frac = max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    if end_ratio == 0.0:
        return frac
    return end_ratio + (1.0 - end_ratio) * frac


@register("LinearWarmupDecayLR", domain="metaopt", host_inputs=(0,), recomputable=False)
def linear_warmup_decay_lr(
    step: torch.Tensor,
    peak_lr: float = 1e-3,
    warmup_steps: int = 0,
    total_steps: int = 1,
    end_lr: float = 0.0,
) -> torch.Tensor:
    """The learning rate of the update with 0-based index `step` (float64 scalar).

    ``peak_lr * factor(step)``, the product torch's LambdaLR forms (``base_lr * lmbda(epoch)``).
    """
    end_ratio = end_lr / peak_lr if peak_lr else 0.0
    if not _on_host(step):
        return peak_lr * _device_factor(step, warmup_steps, total_steps, end_ratio)
    s = int(step.item())  # host read: the schedule is Python-float arithmetic, as in LambdaLR
    factor = linear_warmup_decay_factor(s, warmup_steps, total_steps, end_ratio)
    return torch.tensor(peak_lr * factor, dtype=torch.float64, device=step.device)


def _device_factor(step: torch.Tensor, warmup_steps: int, total_steps: int, end_ratio: float) -> torch.Tensor:
    """`linear_warmup_decay_factor` as float64 tensor ops on the step's device: the same IEEE
    double operations in the same order, so the same bits, with no host read."""
    s = step.to(torch.float64)
    warm = s / float(max(1, warmup_steps))
    frac = torch.clamp((float(total_steps) - s) / float(max(1, total_steps - warmup_steps)), min=0.0)
    decay = frac if end_ratio == 0.0 else end_ratio + (1.0 - end_ratio) * frac
    return torch.where(s < warmup_steps, warm, decay)


# --- clipping -------------------------------------------------------------------------


@register(
    "ClipByGlobalNorm",
    domain="metaopt",
    needs_outputs=True,
    recomputable=False,
    sharded_form="ShardedClipByGlobalNorm",  # ops/kernels/zero.py
)
def clip_by_global_norm(*grads: torch.Tensor, clip_norm: float = 1.0, _nout: int = 1):
    """``torch.nn.utils.clip_grad_norm_(params, clip_norm)`` on copies of the grads.

    The total norm is torch's own ``get_total_norm`` (per-tensor norms, then the norm
    of the stacked norms, foreach where torch would use it); the coefficient
    ``clip_norm / (total + 1e-6)`` clamped to 1 multiplies every grad (always, like
    torch: no host sync to test it). Outputs: the clipped grads, in input order.
    """
    if len(grads) != _nout:
        raise ValueError(f"ClipByGlobalNorm: {len(grads)} grads in but {_nout} outputs")
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    coef = torch.clamp(float(clip_norm) / (total + 1e-6), max=1.0)
    out = tuple(g.mul(coef.to(g.device)) for g in grads)
    return out[0] if _nout == 1 else out


# --- updates --------------------------------------------------------------------------


def update_row(states: int, *, step: bool = True) -> dict[str, Any]:
    """The row fields an update op's input layout fixes (module doc): ``(param, grad, lr[, step],
    *state[, found_inf])`` with `states` state inputs, outputs ``(param, *state)``. lr, step and
    found_inf are host reads, the param and each state are written over their inputs, and
    found_inf is the skip input. One place, so an op's tuples cannot drift from its layout."""
    first = 4 if step else 3  # the first state input
    skip = first + states
    return dict(
        domain="metaopt",
        host_inputs=(2, 3, skip) if step else (2, skip),
        needs_outputs=states > 0,  # outputs (param, *state): the kernel is told how many
        recomputable=False,
        inplace=((0, 0),) + tuple((1 + k, first + k) for k in range(states)),
        update=True,
        skip_input=skip,
    )


def _sgd_multi(groups: list[tuple], weight_decay: float = 0.0) -> list[tuple]:
    """SGDUpdate over several params (torch's _multi_tensor_sgd, momentum 0; bitwise the
    per-op kernel on the CPU). Each group: (param, grad, lr[, found_inf]), lr and found_inf shared."""
    params, grads = [g[0] for g in groups], [g[1] for g in groups]
    first = groups[0]
    if not _on_host(first[0]):
        _device_sgd(params, grads, [], first[2], first[3] if len(first) > 3 else None, weight_decay)
        return [(p,) for p in params]
    if _skip(first[3] if len(first) > 3 else None):
        return [(p,) for p in params]
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)  # new tensors: grads unwritten
    torch._foreach_add_(params, grads, alpha=-first[2].item())
    return [(p,) for p in params]


def _momentum_multi(
    groups: list[tuple], momentum: float = 0.9, dampening: float = 0.0, nesterov: int = 0,
    weight_decay: float = 0.0, _nout: int = 2,
) -> list[tuple]:  # fmt: skip
    """MomentumUpdate over several params (torch's _multi_tensor_sgd; bitwise the per-op kernel on
    the CPU). Each group: (param, grad, lr, step, velocity[, found_inf]), lr, step, found_inf shared."""
    params, grads, bufs = ([g[k] for g in groups] for k in (0, 1, 4))
    first = groups[0]
    outs = list(zip(params, bufs))
    if not _on_host(first[0]):
        found = first[5] if len(first) > 5 else None
        _device_sgd(params, grads, bufs, first[2], found, weight_decay, momentum, dampening, nesterov)
        return outs
    if _skip(first[5] if len(first) > 5 else None):
        return outs
    lr_ = first[2].item()
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if int(first[3].item()) == 1:  # torch: buf = clone(grad), written into the state var
        torch._foreach_copy_(bufs, grads)
    else:
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads, alpha=1 - dampening)
    steps = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
    torch._foreach_add_(params, steps, alpha=-lr_)
    return outs


@register("SGDUpdate", multi=_sgd_multi, sliceable=True, **update_row(0, step=False))
def sgd_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    found_inf: torch.Tensor | None = None,
    weight_decay: float = 0.0,
) -> torch.Tensor:
    """torch.optim.SGD (momentum 0): ``param -= lr * (grad + wd * param)``, in place."""
    if not _on_host(param):
        _device_sgd([param], [grad], [], lr, found_inf, weight_decay)
        return param
    if _skip(found_inf):
        return param
    lr_ = lr.item()  # host read: torch's lr is a Python float
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    return param.add_(grad, alpha=-lr_)


@register("MomentumUpdate", multi=_momentum_multi, sliceable=True, **update_row(1))
def momentum_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    velocity: torch.Tensor,
    found_inf: torch.Tensor | None = None,
    momentum: float = 0.9,
    dampening: float = 0.0,
    nesterov: int = 0,
    weight_decay: float = 0.0,
    _nout: int = 2,
):
    """torch.optim.SGD with momentum: (new param, new velocity).

    On the first update (``step == 1``) torch sets the buffer to a copy of the grad
    (no dampening); afterwards ``buf = momentum * buf + (1 - dampening) * grad``.
    """
    if not _on_host(param):
        _device_sgd([param], [grad], [velocity], lr, found_inf, weight_decay, momentum, dampening, nesterov)
        return param, velocity
    if _skip(found_inf):
        return param, velocity
    lr_ = lr.item()  # host reads: torch's lr is a Python float, and the first step is a branch
    first = int(step.item()) == 1
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    buf = velocity
    if first:  # torch: buf = clone(grad); the same values, written into the state var
        buf.copy_(grad)
    else:
        buf.mul_(momentum).add_(grad, alpha=1 - dampening)
    d = grad.add(buf, alpha=momentum) if nesterov else buf
    return param.add_(d, alpha=-lr_), buf


def _adam(
    param, grad, lr, step, exp_avg, exp_avg_sq, max_exp_avg_sq, beta1, beta2, eps, wd, decoupled, fused=0
):  # fmt: skip
    lr_ = lr.item()  # host reads: torch keeps lr and the step as Python floats here
    step_ = float(step.item())
    if fused:
        return _fused_adam(
            param, grad, lr_, step_, exp_avg, exp_avg_sq, max_exp_avg_sq, beta1, beta2, eps, wd, decoupled
        )
    if wd != 0:
        if decoupled:
            param.mul_(1 - lr_ * wd)
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step_
    bias_correction2 = 1 - beta2**step_
    step_size = lr_ / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    return (
        (param, exp_avg, exp_avg_sq)
        if max_exp_avg_sq is None
        else (param, exp_avg, exp_avg_sq, max_exp_avg_sq)
    )


def _fused_adam(
    param, grad, lr_, step_, exp_avg, exp_avg_sq, max_exp_avg_sq, beta1, beta2, eps, wd, decoupled
):
    """torch.optim.Adam(fused=True)'s kernel on one param: one pass over param, grad and state
    (the single-tensor form makes about seven), one kernel launch on CUDA instead of about
    seven. Its arithmetic is the fused kernel's, not the single-tensor form's (they differ in
    the last bit), so it is bitwise equal to torch.optim.Adam(fused=True), not to the default."""
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fn(
        [param], [grad], [exp_avg], [exp_avg_sq], [] if max_exp_avg_sq is None else [max_exp_avg_sq],
        [_step_tensor(step_, param.device)], lr=lr_, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps,
        amsgrad=max_exp_avg_sq is not None, maximize=False,
    )  # fmt: skip
    return (param, exp_avg, exp_avg_sq) + (() if max_exp_avg_sq is None else (max_exp_avg_sq,))


def _adam_multi(
    groups: list[tuple], *, decoupled: bool, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
    weight_decay: float = 0.0, amsgrad: int = 0, fused: int = 0, _nout: int = 3,
) -> list[tuple]:  # fmt: skip
    """Adam/AdamW over several params at once, as ``torch/optim/adam.py::_multi_tensor_adam``
    (torch.optim's default on CUDA: a handful of kernel launches for all params, not ~7 per
    param). On the CPU, foreach ops run per tensor the same ops as the single-tensor form:
    bitwise equal to it. The group shares lr, step and found_inf (the rows' host inputs)."""
    # each group: (param, grad, lr, step, exp_avg, exp_avg_sq[, max_exp_avg_sq][, found_inf])
    params, grads, exp_avgs, exp_avg_sqs = ([g[k] for g in groups] for k in (0, 1, 4, 5))
    max_sqs = [g[6] for g in groups] if amsgrad else None
    first = groups[0]
    _check_amsgrad(
        "AdamWUpdate" if decoupled else "AdamUpdate", amsgrad, first[6] if len(first) > 6 else None, _nout
    )
    found_inf = first[7] if len(first) > 7 else None
    outs = [
        (p, m, v) + ((mx,) if amsgrad else ())
        for p, m, v, mx in zip(params, exp_avgs, exp_avg_sqs, max_sqs or params)
    ]
    if not _on_host(first[0]):
        _device_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_sqs or [], first[2], first[3], found_inf,
            beta1, beta2, epsilon, weight_decay, decoupled,
        )  # fmt: skip
        return outs
    if _skip(found_inf):
        return outs
    lr_, step_ = first[2].item(), float(first[3].item())
    if fused:
        fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
        fn(
            params, grads, exp_avgs, exp_avg_sqs, max_sqs or [],
            [_step_tensor(step_, params[0].device)] * len(params),
            lr=lr_, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=epsilon, amsgrad=bool(amsgrad),
            maximize=False,
        )  # fmt: skip
        return outs
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr_ * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_size = lr_ / (1 - beta1**step_)
    bias_correction2_sqrt = (1 - beta2**step_) ** 0.5
    if max_sqs is not None:
        torch._foreach_maximum_(max_sqs, exp_avg_sqs)
        denom = torch._foreach_sqrt(max_sqs)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, epsilon)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)
    return outs


def _device_adam(
    params, grads, exp_avgs, exp_avg_sqs, max_sqs, lr, step, found_inf, beta1, beta2, eps, wd, decoupled
) -> None:  # fmt: skip
    """The device form of Adam/AdamW (module doc): torch's fused kernel, lr and step as device
    tensors, the skip inside the kernel. torch.optim keeps a float32 step per param; the
    kernel only reads it, so one tensor serves every param of the call."""
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    steps = [step.to(params[0].device, torch.float32)] * len(params)
    fn(
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, lr=_lr_arg(lr, params[0]),
        beta1=beta1, beta2=beta2,
        weight_decay=wd, eps=eps, amsgrad=bool(max_sqs), maximize=False, found_inf=_flag(found_inf),
    )  # fmt: skip


def _device_sgd(
    params, grads, bufs, lr, found_inf, weight_decay, momentum=0.0, dampening=0.0, nesterov=0
) -> None:  # fmt: skip
    """The device form of SGD / SGD with momentum (module doc): torch's fused kernel.

    torch's first momentum step sets the buffer to the grad; the fused kernel's later-step rule
    on the zero buffer the optimizer starts from gives exactly that when dampening is 0
    (``momentum * 0 + 1 * grad``). With dampening it would not, and telling the first step
    apart needs the step's value on the host."""
    if bufs and dampening != 0:
        raise NotImplementedError(
            f"SGD with momentum and dampening={dampening} off the CPU: its first step (buffer = grad, "
            "undamped) needs the step count on the host; use dampening=0 or the CPU"
        )
    torch._fused_sgd_(
        params, grads, bufs, weight_decay=weight_decay, momentum=momentum if bufs else 0.0,
        lr=_lr_arg(lr, params[0]),
        dampening=dampening, nesterov=bool(nesterov), maximize=False, is_first_step=False,
        found_inf=_flag(found_inf),
    )  # fmt: skip


_STEPS: dict[torch.device, tuple[float, torch.Tensor]] = {}


def _step_tensor(step: float, device: torch.device) -> torch.Tensor:
    """The step as the float32 tensor on `device` the fused kernels read (torch.optim keeps one per
    param: state["step"]); one per device and step value, shared by a step's update ops (the
    kernels only read it), so CUDA gets one small copy per step, not one per param."""
    held = _STEPS.get(device)
    if held is None or held[0] != step:
        held = _STEPS[device] = (step, torch.tensor(step, dtype=torch.float32, device=device))
    return held[1]


_ADAM_DOC = """torch.optim.{cls} (single tensor): (new param, exp_avg, exp_avg_sq[, max_exp_avg_sq]).

Inputs ``(param, grad, lr, step, exp_avg, exp_avg_sq[, max_exp_avg_sq][, found_inf])``; the
third moment input/output is there iff ``amsgrad=1``. `step` is the 1-based update number.
"""


def _adam_kernel(op: str, decoupled: bool, default_weight_decay: float):
    """The kernel of `op`: AdamUpdate (L2 decay) or AdamWUpdate (decoupled), one body."""

    def kernel(
        param, grad, lr, step, exp_avg, exp_avg_sq, max_exp_avg_sq=None, found_inf=None,
        beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
        weight_decay: float = default_weight_decay, amsgrad: int = 0, fused: int = 0, _nout: int = 3,
    ):  # fmt: skip
        _check_amsgrad(op, amsgrad, max_exp_avg_sq, _nout)
        if not _on_host(param):
            mx = [] if max_exp_avg_sq is None else [max_exp_avg_sq]
            _device_adam(
                [param], [grad], [exp_avg], [exp_avg_sq], mx, lr, step, found_inf,
                beta1, beta2, epsilon, weight_decay, decoupled,
            )  # fmt: skip
            return _unchanged(param, exp_avg, exp_avg_sq, max_exp_avg_sq)
        if _skip(found_inf):
            return _unchanged(param, exp_avg, exp_avg_sq, max_exp_avg_sq)
        return _adam(
            param, grad, lr, step, exp_avg, exp_avg_sq, max_exp_avg_sq,
            beta1, beta2, epsilon, weight_decay, decoupled, fused,
        )  # fmt: skip

    kernel.__name__ = kernel.__qualname__ = f"{op[:-6].lower()}_update"
    return kernel


# Inputs (param, grad, lr, step, exp_avg, exp_avg_sq[, max_exp_avg_sq][, found_inf]): the optional
# amsgrad state counts among the states, so found_inf sits at 7 whether it is there or not.
_ADAM_ROW = dict(sliceable=True, **update_row(3))
adam_update = register(
    "AdamUpdate", multi=lambda groups, **attrs: _adam_multi(groups, decoupled=False, **attrs), **_ADAM_ROW
)(_adam_kernel("AdamUpdate", False, 0.0))
adamw_update = register(
    "AdamWUpdate", multi=lambda groups, **attrs: _adam_multi(groups, decoupled=True, **attrs), **_ADAM_ROW
)(_adam_kernel("AdamWUpdate", True, 0.01))
adam_update.__doc__ = _ADAM_DOC.format(cls="Adam") + "L2 weight decay: ``grad + wd * param``.\n"
adamw_update.__doc__ = _ADAM_DOC.format(cls="AdamW") + "Decoupled decay: ``param * (1 - lr * wd)`` first.\n"


def _unchanged(param, exp_avg, exp_avg_sq, max_exp_avg_sq):
    return (param, exp_avg, exp_avg_sq) + (() if max_exp_avg_sq is None else (max_exp_avg_sq,))


def _check_amsgrad(op: str, amsgrad: int, max_exp_avg_sq, nout: int) -> None:
    want = 4 if amsgrad else 3
    if (max_exp_avg_sq is not None) != bool(amsgrad) or nout != want:
        raise ValueError(
            f"{op}: amsgrad={amsgrad} needs {want} state inputs/outputs "
            f"(got max_exp_avg_sq={'a tensor' if max_exp_avg_sq is not None else 'none'}, {nout} outputs)"
        )

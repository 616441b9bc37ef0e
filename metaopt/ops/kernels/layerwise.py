"""Layer-wise adaptive updates: LAMB and LARS (Fleet's ``strategy.lamb`` / ``strategy.lars``
meta optimizers; passes/layerwise.py swaps them in for Adam's and Momentum's updates).

Both scale each param's step by a ratio of whole-tensor norms, so neither is elementwise
(``sliceable`` stays False: ZeRO refuses them by name). The formulas are Paddle's:

* ``LambUpdate`` (You et al., Paddle's ``lamb`` op with bias correction)::

      m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
      r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd p
      p = p - lr * (||p|| / ||r|| if both > 0 else 1) * r

* ``LarsMomentumUpdate`` (You et al. 2017, Paddle's ``lars_momentum`` op)::

      local_lr = lr * coeff * ||p|| / (||g|| + wd ||p|| + eps)   if ||p|| > 0 and ||g|| > 0, else lr
      v = mu v + local_lr * (g + wd p)
      p = p - v

The ratios stay device tensors (no host read beyond the learning rate and step every update
op reads); a step AMP skips (``found_inf``) leaves param and state as they were.
"""

from __future__ import annotations

import torch

from metaopt.ops.kernels.optim import _skip, update_row
from metaopt.ops.registry import register


def _ratio(num: torch.Tensor, den: torch.Tensor, value: torch.Tensor, otherwise: float) -> torch.Tensor:
    """`value` where both norms are positive, else `otherwise` (a zero param or step)."""
    return torch.where((num > 0) & (den > 0), value, torch.full_like(value, otherwise))


@register("LambUpdate", **update_row(2))
def lamb_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    found_inf: torch.Tensor | None = None,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-6,
    weight_decay: float = 0.01,
    _nout: int = 3,
):
    """LAMB (module doc): (new param, new first moment, new second moment), in place."""
    if _skip(found_inf):
        return param, exp_avg, exp_avg_sq
    lr_, t = lr.item(), float(step.item())
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    r = (exp_avg / (1 - beta1**t)) / ((exp_avg_sq / (1 - beta2**t)).sqrt() + epsilon)
    if weight_decay != 0:
        r.add_(param, alpha=weight_decay)
    p_norm, r_norm = torch.linalg.vector_norm(param), torch.linalg.vector_norm(r)
    trust = _ratio(p_norm, r_norm, p_norm / r_norm, 1.0)
    param.sub_(r.mul_(trust * lr_))
    return param, exp_avg, exp_avg_sq


@register("LarsMomentumUpdate", **update_row(1))
def lars_momentum_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    velocity: torch.Tensor,
    found_inf: torch.Tensor | None = None,
    momentum: float = 0.9,
    lars_coeff: float = 0.001,
    lars_weight_decay: float = 0.0005,
    epsilon: float = 0.0,
    _nout: int = 2,
):
    """LARS momentum (module doc): (new param, new velocity), in place. `step` is read by
    nothing: the op keeps Momentum's inputs, so the rewrite is a swap of type and attrs."""
    if _skip(found_inf):
        return param, velocity
    lr_ = lr.item()
    p_norm, g_norm = torch.linalg.vector_norm(param), torch.linalg.vector_norm(grad)
    scaled = lr_ * lars_coeff * p_norm / (g_norm + lars_weight_decay * p_norm + epsilon)
    local_lr = _ratio(p_norm, g_norm, scaled, lr_)
    d = grad.add(param, alpha=lars_weight_decay) if lars_weight_decay != 0 else grad.clone()
    velocity.mul_(momentum).add_(d.mul_(local_lr))
    param.sub_(velocity)
    return param, velocity

"""Gradient clipping (Paddle's ``paddle.nn.ClipGradByGlobalNorm`` name, torch's semantics)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ClipGradByGlobalNorm"]


class ClipGradByGlobalNorm:
    """Scale all grads by ``min(1, clip_norm / (total_norm + 1e-6))``.

    ``total_norm`` is the 2-norm of all the optimizer's grads taken together. This is
    ``torch.nn.utils.clip_grad_norm_(params, clip_norm)`` (computed the same way: the
    norm of each grad, then the norm of those norms), not Paddle's
    ``clip_norm / max(total_norm, clip_norm)``. Applied by `apply_optimizer` as one
    ``ClipByGlobalNorm`` op (role optimize) before the update ops; weight decay is
    applied after clipping, inside the update, as in torch.
    """

    op_type = "ClipByGlobalNorm"

    def __init__(self, clip_norm: float) -> None:
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
            raise TypeError(f"clip_norm must be a float, got {type(clip_norm).__name__} {clip_norm!r}")
        if not math.isfinite(clip_norm) or clip_norm <= 0:
            raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm!r}")
        self.clip_norm = float(clip_norm)

    def attrs(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm}

    def __repr__(self) -> str:
        return f"ClipGradByGlobalNorm(clip_norm={self.clip_norm!r})"

"""Learning-rate schedules (Paddle's ``paddle.optimizer.lr``, torch's LambdaLR semantics).

A schedule is a description; `apply_optimizer` turns it into lr-sched ops that compute
the rate in the program from the persistable step counter ``global_step``.

Step indexing (matches ``torch.optim.lr_scheduler.LambdaLR`` + ``optimizer.step()``):
``global_step`` holds how many updates have been made. The k-th update (k = 1, 2, ...)
runs with ``global_step == k - 1`` and uses the rate ``lr_at(k - 1)`` — the first update
uses ``lr_at(0)``, exactly as torch's loop ``opt.step(); sched.step()`` uses
``base_lr * lr_lambda(0)`` for its first step (LambdaLR's constructor already made
``last_epoch = 0``). Adam's bias corrections use the 1-based ``k``, as torch's
``state["step"]`` does.

The program's ``learning_rate`` var (float64 scalar, persistable, in the executor's
scope) holds the rate the last update used:

* `Constant`: no op computes it; the update ops read ``learning_rate`` itself, so
  ``exe.scope["learning_rate"].fill_(x)`` changes the rate of every later update.
* `LinearWarmupDecay`: an lr-sched op computes it from the step counter every step and
  writes it back, so an edit of the scope value is overwritten by the schedule (as with
  a Paddle LRScheduler).
"""

from __future__ import annotations

import math
from typing import Any

from metaopt.ops.kernels.optim import linear_warmup_decay_factor

__all__ = ["Constant", "LRScheduler", "LinearWarmupDecay"]


def _check_rate(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


def _check_int(what: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


class LRScheduler:
    """Base of the schedules: ``lr_at(step)`` is the rate of the update with 0-based index `step`."""

    #: op type of the lr-sched op computing the rate; None = the rate is the var itself.
    op_type: str | None = None

    def lr_at(self, step: int) -> float:
        raise NotImplementedError

    def attrs(self) -> dict[str, Any]:
        """Attributes of the lr-sched op (`op_type`)."""
        return {}

    @property
    def initial_lr(self) -> float:
        """The rate of the first update: the ``learning_rate`` var's initial value."""
        return self.lr_at(0)


class Constant(LRScheduler):
    """A fixed rate, changeable at run time through ``exe.scope["learning_rate"]``."""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = _check_rate("learning_rate", learning_rate)

    def lr_at(self, step: int) -> float:
        return self.learning_rate

    def __repr__(self) -> str:
        return f"Constant({self.learning_rate!r})"


class LinearWarmupDecay(LRScheduler):
    """Linear warmup 0 -> `peak_lr` over `warmup_steps`, then linear decay to `end_lr` at `total_steps`.

    ``lr_at(step) = peak_lr * lr_lambda(step)`` with
    ``lr_lambda(step) = step / max(1, warmup_steps)`` while ``step < warmup_steps``, else
    ``r + (1 - r) * max(0, (total_steps - step) / max(1, total_steps - warmup_steps))``
    with ``r = end_lr / peak_lr`` (held at `end_lr` after `total_steps`). With
    ``end_lr=0`` this is transformers' ``get_linear_schedule_with_warmup`` and equals
    ``torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)`` rate for rate (bitwise), with
    the step indexing described in this module's docstring: the first update uses
    ``lr_at(0) == 0`` when ``warmup_steps > 0``.
    """

    op_type = "LinearWarmupDecayLR"

    def __init__(self, peak_lr: float, warmup_steps: int, total_steps: int, end_lr: float = 0.0) -> None:
        self.peak_lr = _check_rate("peak_lr", peak_lr)
        if self.peak_lr == 0:
            raise ValueError("peak_lr must be > 0 (the schedule scales it)")
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.total_steps = _check_int("total_steps", total_steps, 1)
        if self.total_steps < self.warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
        self.end_lr = _check_rate("end_lr", end_lr)
        if self.end_lr > self.peak_lr:
            raise ValueError(f"end_lr ({end_lr}) must be <= peak_lr ({peak_lr})")

    def lr_lambda(self, step: int) -> float:
        """The multiplier of `peak_lr` (what LambdaLR's ``lr_lambda`` returns)."""
        end_ratio = self.end_lr / self.peak_lr
        return linear_warmup_decay_factor(step, self.warmup_steps, self.total_steps, end_ratio)

    def lr_at(self, step: int) -> float:
        return self.peak_lr * self.lr_lambda(step)

    def attrs(self) -> dict[str, Any]:
        return {
            "peak_lr": self.peak_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "end_lr": self.end_lr,
        }

    def __repr__(self) -> str:
        return (
            f"LinearWarmupDecay(peak_lr={self.peak_lr!r}, warmup_steps={self.warmup_steps}, "
            f"total_steps={self.total_steps}, end_lr={self.end_lr!r})"
        )


def as_schedule(learning_rate: float | LRScheduler) -> LRScheduler:
    """A float becomes `Constant`; a schedule is kept."""
    if isinstance(learning_rate, LRScheduler):
        return learning_rate
    return Constant(learning_rate)

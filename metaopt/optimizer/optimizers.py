"""SGD, Momentum, Adam, AdamW: Paddle/Fleet constructor names, torch.optim semantics and defaults.

An optimizer object is a description. `minimize(loss)` appends the backward
(``metaopt.passes.backward.append_backward``) and the update ops
(`metaopt.passes.optimize.apply_optimizer`) and rewrites the loss's program in place,
as Fleet's ``minimize`` does; `apply_gradients` appends only the update ops.

What each maps to (bitwise equal to torch's single-tensor implementation on CPU):

=========  ========================================================  ==================
ours        torch                                                     state vars
=========  ========================================================  ==================
SGD         ``SGD(lr, weight_decay=wd)``                              none
Momentum    ``SGD(lr, momentum, dampening, weight_decay, nesterov)``  ``p@VELOCITY``
Adam        ``Adam(lr, (beta1, beta2), eps, weight_decay, amsgrad)``  ``p@MOMENT1``, ``p@MOMENT2``
AdamW       ``AdamW(...)`` (decoupled decay, default wd 0.01)         (+ ``p@MAX_MOMENT2``)
=========  ========================================================  ==================

Shared state: ``global_step`` (int64, the number of updates made) and
``learning_rate`` (float64: torch's rate is a Python double; see `metaopt.optimizer.lr`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from metaopt.ir import Op, Program, Var, names
from metaopt.optimizer.clip import ClipGradByGlobalNorm
from metaopt.optimizer.lr import LRScheduler, as_schedule

__all__ = ["SGD", "Adam", "AdamW", "Momentum", "Optimizer"]


def _check_float(what: str, value: Any, lo: float = 0.0, hi: float | None = None, hi_open=True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    bad = not math.isfinite(value) or value < lo
    if hi is not None:
        bad = bad or (value >= hi if hi_open else value > hi)
    if bad:
        rng = f"in [{lo}, {hi}{')' if hi_open else ']'}" if hi is not None else f">= {lo}"
        raise ValueError(f"{what} must be {rng}, got {value!r}")
    return value


class Optimizer:
    """Base class: learning rate (float or schedule), weight decay, gradient clipping."""

    _op_type = ""
    _needs_step = False  # whether the update op reads the (1-based) step number

    def __init__(
        self,
        learning_rate: float | LRScheduler = 1e-3,
        weight_decay: float = 0.0,
        grad_clip: ClipGradByGlobalNorm | None = None,
    ) -> None:
        self.learning_rate = as_schedule(learning_rate)
        self.weight_decay = _check_float("weight_decay", weight_decay)
        if grad_clip is not None and not isinstance(grad_clip, ClipGradByGlobalNorm):
            raise TypeError(
                f"grad_clip must be a metaopt.optimizer.ClipGradByGlobalNorm or None, got {grad_clip!r}"
            )
        self.grad_clip = grad_clip

    # --- what the optimize pass emits ----------------------------------------------
    def update_op_type(self) -> str:
        return self._op_type

    def needs_step(self) -> bool:
        return self._needs_step

    def update_attrs(self) -> dict[str, Any]:
        return {"weight_decay": self.weight_decay}

    def state_names(self, param: str) -> dict[str, str]:
        """torch ``optimizer.state[p]`` key -> state var name, in the update op's input order."""
        return {}

    # --- Fleet's API ------------------------------------------------------------------
    def apply_gradients(
        self, params_grads: Sequence[tuple[str | Var, str | Var]], program: Program | None = None
    ) -> list[Op]:
        """Append the update ops for `params_grads` to `program`, in place; returns them.

        `params_grads` holds ``(param, grad)`` pairs of names or `Var`s. `program` may be
        left out when the pairs hold `Var`s: it is then their program (``var.program``).
        """
        from metaopt.passes.optimize import apply_optimizer

        program = program if program is not None else _program_of(params_grads)
        new, ops = apply_optimizer(program, optimizer=self, params_grads=params_grads)
        return _rewrite_in_place(program, new, ops)

    def minimize(
        self,
        loss: Var,
        startup_program: Program | None = None,
        parameter_list: Iterable[str | Var] | None = None,
        no_grad_set: Iterable[str | Var] | None = None,
    ) -> tuple[list[Op], list]:
        """Append backward and update ops to ``loss.program`` in place: ``(optimize_ops, params_grads)``.

        `startup_program` is accepted for Fleet compatibility and unused: initial values
        (params and optimizer state) live in ``program.values``. Nothing is changed when
        either pass fails.
        """
        if not isinstance(loss, Var):
            raise TypeError(f"minimize(loss): loss must be a metaopt Var (e.g. program.loss), got {loss!r}")
        program = loss.program
        if program is None:
            raise ValueError(f"loss var {loss.name!r} belongs to no program (take it from program.loss)")
        if startup_program is not None and not isinstance(startup_program, Program):
            raise TypeError(f"startup_program must be a Program or None, got {startup_program!r}")
        from metaopt.passes.driver import Context, run_steps  # written beside this; imported late
        from metaopt.passes.minimize import MINIMIZE_STEPS, check_forward_only

        check_forward_only(program, f"{type(self).__name__}.minimize")
        ctx = Context(
            strategy=None,
            optimizer=self,
            parameter_list=_names(parameter_list),
            no_grad_set=_names(no_grad_set),
            loss=loss.name,
        )
        new = run_steps(program, MINIMIZE_STEPS, ctx)  # each step verified and dumped
        optimize_ops = _rewrite_in_place(program, new, ctx.optimize_ops)
        return optimize_ops, [
            tuple(program.var(x.name) if isinstance(x, Var) else x for x in pair) for pair in ctx.params_grads
        ]

    def __repr__(self) -> str:
        args = [f"{k}={v!r}" for k, v in vars(self).items() if v is not None]
        return f"{type(self).__name__}({', '.join(args)})"


class SGD(Optimizer):
    """Plain SGD: ``p -= lr * (g + weight_decay * p)`` (torch.optim.SGD with momentum 0)."""

    _op_type = "SGDUpdate"  # constructed as the base: a rate, weight decay and clipping, no state


class Momentum(Optimizer):
    """SGD with momentum (torch.optim.SGD): the first update sets the buffer to the grad.

    ``momentum=0`` is plain SGD (no state, a ``SGDUpdate`` op), as in torch.
    """

    _op_type = "MomentumUpdate"
    _needs_step = True

    def __init__(
        self,
        learning_rate: float | LRScheduler = 1e-3,
        momentum: float = 0.9,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        grad_clip: ClipGradByGlobalNorm | None = None,
    ) -> None:
        super().__init__(learning_rate, weight_decay, grad_clip)
        self.momentum = _check_float("momentum", momentum)
        self.dampening = _check_float("dampening", dampening, lo=-math.inf)
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov momentum requires momentum > 0 and dampening == 0 "
                f"(got momentum={momentum}, dampening={dampening})"
            )

    def update_op_type(self) -> str:
        return self._op_type if self.momentum != 0 else SGD._op_type

    def needs_step(self) -> bool:
        return self.momentum != 0

    def update_attrs(self) -> dict[str, Any]:
        if self.momentum == 0:
            return {"weight_decay": self.weight_decay}
        return {
            "momentum": self.momentum,
            "dampening": self.dampening,
            "nesterov": int(self.nesterov),
            "weight_decay": self.weight_decay,
        }

    def state_names(self, param: str) -> dict[str, str]:
        return {"momentum_buffer": names.velocity(param)} if self.momentum != 0 else {}


class Adam(Optimizer):
    """Adam (torch.optim.Adam): L2 weight decay added to the grad; optional AMSGrad.

    ``fused=True``: torch's fused kernel, as ``torch.optim.Adam(fused=True)``: one pass over each
    param and its state (one kernel launch on CUDA, not ~7), bitwise equal to torch's fused
    optimizer, which differs from the default (single-tensor) one in the last bit."""

    _op_type = "AdamUpdate"
    _needs_step = True
    _default_weight_decay = 0.0  # torch.optim.Adam's

    def __init__(
        self,
        learning_rate: float | LRScheduler = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        grad_clip: ClipGradByGlobalNorm | None = None,
        *,
        fused: bool = False,
    ) -> None:
        """`weight_decay` None: the class's default, as torch's (Adam 0, AdamW 0.01)."""
        if weight_decay is None:
            weight_decay = self._default_weight_decay
        super().__init__(learning_rate, weight_decay, grad_clip)
        self.beta1 = _check_float("beta1", beta1, 0.0, 1.0)
        self.beta2 = _check_float("beta2", beta2, 0.0, 1.0)
        self.epsilon = _check_float("epsilon", epsilon)
        self.amsgrad = bool(amsgrad)
        self.fused = bool(fused)

    def update_attrs(self) -> dict[str, Any]:
        attrs = {
            "beta1": self.beta1,
            "beta2": self.beta2,
            "epsilon": self.epsilon,
            "weight_decay": self.weight_decay,
            "amsgrad": int(self.amsgrad),
        }
        if self.fused:  # printed only when on: programs without it read as before
            attrs["fused"] = 1
        return attrs

    def state_names(self, param: str) -> dict[str, str]:
        out = {"exp_avg": names.moment(param, 1), "exp_avg_sq": names.moment(param, 2)}
        if self.amsgrad:
            out["max_exp_avg_sq"] = names.max_moment(param, 2)
        return out


class AdamW(Adam):
    """AdamW (torch.optim.AdamW): decoupled decay ``p *= 1 - lr * weight_decay`` before the Adam step."""

    _op_type = "AdamWUpdate"
    _default_weight_decay = 0.01  # torch.optim.AdamW's: the only difference in construction


# --- helpers ------------------------------------------------------------------------


def _names(xs: Iterable[str | Var] | None) -> list[str] | None:
    if xs is None:
        return None
    return [x.name if isinstance(x, Var) else x for x in xs]


def _program_of(params_grads: Sequence[tuple[str | Var, str | Var]]) -> Program:
    for pair in params_grads:
        for x in pair:
            if isinstance(x, Var) and x.program is not None:
                return x.program
    raise ValueError("apply_gradients: pass program=... (params_grads holds names, not Vars of a program)")


def _rewrite_in_place(program: Program, new: Program, ops: list[Op]) -> list[Op]:
    """`program.replace_with(new)`; returns `program`'s own copies of `ops` (same positions)."""
    index = {id(op): i for i, op in enumerate(new.ops)}
    at = [index[id(op)] for op in ops]
    program.replace_with(new)
    return [program.ops[i] for i in at]

"""The two steps every training rewrite starts with: the backward, then the optimizer's
update ops. `Optimizer.minimize` runs them alone through the driver (`run_steps`: each step's
result verified and dumped); fleet's STEPS runs them among its others, in its order."""

from __future__ import annotations

from typing import Any

from metaopt.ir import Program, roles
from metaopt.ir.printer import fmt_op
from metaopt.passes.driver import Context, Step, check_declarations


class AlreadyMinimized(ValueError):
    """minimize called on a program that already holds a backward (a second minimize call)."""


def check_forward_only(p: Program, who: str) -> None:
    """Raise AlreadyMinimized, naming the first op past the forward, unless `p` is a forward
    program: a second minimize would otherwise fail inside whichever step first meets the
    backward, naming that step instead of the cause."""
    op = next((op for op in p.ops if roles.after_forward(op.role)), None)
    if op is not None:
        line = " ".join(fmt_op(op).split())
        raise AlreadyMinimized(
            f"{who}: program {p.name!r} is already minimized (it has backward or update ops, first: "
            f"{line}): minimize a forward program (export or load it again), or run this one"
        )


def always(ctx: Context) -> tuple[bool, str]:
    return True, "always"


def _append_backward(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.backward import append_backward, loss_grad_seed

    how = {"parameter_list": ctx.parameter_list, "no_grad_set": ctx.no_grad_set}
    q, pairs = append_backward(p, loss=ctx.loss, **how)
    ctx.params_grads = pairs
    ctx.loss_grad = loss_grad_seed(q, ctx.loss)  # the seed append_backward made
    return q


def _apply_optimizer(p: Program, plan: Any, ctx: Context) -> Program:
    from metaopt.passes.optimize import apply_optimizer

    q, ctx.optimize_ops = apply_optimizer(p, optimizer=ctx.optimizer, params_grads=ctx.params_grads)
    return q


APPEND_BACKWARD = Step(
    "append_backward",
    always,
    _append_backward,
    doc="grad ops, (param, grad) pairs",
    reads=("loss", "no_grad_set", "parameter_list"),
    writes=("loss_grad", "params_grads"),
)
APPLY_OPTIMIZER = Step(
    "apply_optimizer",
    always,
    _apply_optimizer,
    doc="step counter, lr, clipping, update ops",
    reads=("optimizer", "params_grads"),
    writes=("optimize_ops",),
)
MINIMIZE_STEPS = (APPEND_BACKWARD, APPLY_OPTIMIZER)
check_declarations(MINIMIZE_STEPS)

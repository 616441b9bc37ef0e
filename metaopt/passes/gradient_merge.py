"""Gradient merge (Fleet's ``strategy.gradient_merge``): one update every k runs.

    program = gradient_merge(program, k_steps=4, avg=True, loss_grad=seed)

On a training program (backward and updates appended), every grad the update-phase ops
read (clipping, the updates) is accumulated into a persistable buffer right after the
backward makes it::

    w@GRAD@MERGED@NEW = GradMerge(w@GRAD@MERGED, w@GRAD, gradient_merge_step)   # role=backward

(a copy on the first run of a window, an in-place add after), and the update-phase ops read
the merged grad. ``Program.gradient_merge`` tells the executor to run the update phase
(and data parallel's all-reduce, placed with the updates) only on the k-th run of each
window: the other runs are forward and backward alone. The executor keeps the window's run
index in the persistable ``gradient_merge_step`` (saved with the other persistables, so a
resumed run continues its window). With ``avg`` the loss grad's seed is divided by k, so
the merged grads are the mean of the k runs' grads (Fleet's ``avg=True``): k runs of a mean
loss over b samples update like one run over k x b. Pure: returns a rewritten copy.
"""

from __future__ import annotations

import torch

from metaopt.ir import GradientMergeInfo, Op, Program, Var, names, roles
from metaopt.passes.optimize import update_grads


class GradientMergeError(ValueError):
    pass


def gradient_merge(p: Program, *, k_steps: int, avg: bool = True, loss_grad: str | None) -> Program:
    """A copy of `p` that updates every `k_steps` runs from the grads summed (or, with
    `avg`, averaged) over those runs (module doc). `loss_grad`: the backward's seed."""
    if isinstance(k_steps, bool) or not isinstance(k_steps, int) or k_steps < 1:
        raise GradientMergeError(f"gradient merge: k_steps must be an int >= 1, got {k_steps!r}")
    if p.gradient_merge is not None:
        raise GradientMergeError(f"program {p.name!r} already merges gradients: gradient_merge runs once")
    grads = update_grads(p)
    if not grads:
        raise GradientMergeError(f"program {p.name!r} has no update ops reading grads: nothing to merge")
    q = p.clone()
    if k_steps == 1:
        return q
    step = names.merge_step()
    if step in q.vars:
        raise GradientMergeError(f"program {q.name!r} already has a var {step!r}")
    q.add_var(Var(step, "int64", (), "opt_state"), torch.zeros((), dtype=torch.int64))
    producers = q.producers()
    # an accumulator of a tensor-parallel param's grad is split as the param is (checkpoints save it)
    split = {
        op.inputs[1]: q.vars[op.inputs[0]].split
        for op in q.ops
        if roles.is_update(op.role) and len(op.inputs) > 1
    }
    meta = any(q.is_meta(v.name) for v in q.params())  # an export on meta: accumulators filled at first use
    merged: dict[str, str] = {}
    after: dict[int, list[Op]] = {}
    for g in grads:
        v = q.vars[g]
        acc, new = names.merged(g), names.new_state(names.merged(g))
        for n in (acc, new):
            if n in q.vars:
                raise GradientMergeError(f"program {q.name!r} already has a var {n!r}")
        acc_var = Var(acc, v.dtype, v.shape, "opt_state", split=split.get(g))
        _static(v)  # an accumulator has the grad's shape: it must be known before any run
        q.add_var(acc_var)
        q.set_filled(acc, 0.0, meta=meta)
        q.add_var(Var(new, v.dtype, v.shape, "grad"))
        q.updates[acc] = new
        merged[g] = new
        op = Op("GradMerge", [acc, g, step], [new], role="backward", origin=g)
        after.setdefault(producers[g], []).append(op)
    ops: list[Op] = []
    first_update = min(i for i, op in enumerate(q.ops) if roles.is_update(op.role))
    for i, op in enumerate(q.ops):
        if i >= first_update and roles.is_update(op.role):
            op.inputs = [merged.get(x, x) for x in op.inputs]
        ops.append(op)
        ops.extend(after.get(i, []))
    q.ops = ops
    if avg:
        _divide_seed(q, loss_grad, k_steps)
    q.gradient_merge = GradientMergeInfo(k_steps=k_steps, avg=bool(avg), step=step)
    return q


def _divide_seed(q: Program, loss_grad: str | None, k: int) -> None:
    """The seed d(loss)/d(loss) = 1/k: every grad of the run is the k-th part of the mean."""
    if loss_grad is None or loss_grad not in q.vars:
        raise GradientMergeError(f"gradient merge avg=True: the loss grad {loss_grad!r} is not in {q.name!r}")
    seed = q.ops[q.producers()[loss_grad]]
    const = seed.inputs[0] if seed.inputs else None
    if const is None or q.vars[const].kind != "constant":
        raise GradientMergeError(f"gradient merge avg=True: {loss_grad!r} is not made from a constant seed")
    name = names.fresh(names.divided(const, k), q.vars)
    v = q.vars[const]
    q.add_var(Var(name, v.dtype, v.shape, "constant"), q.values[const] / k)
    seed.inputs = [name, *seed.inputs[1:]]


def _static(v: Var) -> tuple[int, ...]:
    if v.shape is None or not all(isinstance(d, int) for d in v.shape):
        raise GradientMergeError(f"gradient merge: grad {v.name!r} has no static shape ({v.shape})")
    return tuple(v.shape)

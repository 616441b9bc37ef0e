"""The optimizer pass: append lr-sched, clipping and update ops (Fleet's optimizer ops).

`apply_optimizer(program, optimizer=..., params_grads=...)` is pure: it clones
`program` and appends, in order,

1. lr-sched ops (role ``lr-sched``)::

     global_step@NEW = StepCounter(global_step)                          # the 1-based update number
     learning_rate@NEW = LinearWarmupDecayLR(global_step, peak_lr=...)   # schedules only

   ``global_step`` (int64) and ``learning_rate`` (float64) are persistable
   ``opt_state`` vars written back through ``program.updates``. With a constant rate
   no op computes ``learning_rate``: the update ops read the var itself, so a user may
   change it in ``exe.scope["learning_rate"]`` between runs.
2. with ``grad_clip``, one ``ClipByGlobalNorm`` op over all grads (role ``optimize``)
   producing ``g@CLIP`` for each grad ``g``;
3. one update op per param (role ``optimize``, ``origin`` = the param)::

     w@NEW, w@MOMENT1@NEW, w@MOMENT2@NEW = AdamUpdate(w, w@GRAD, learning_rate, global_step@NEW,
                                                      w@MOMENT1, w@MOMENT2, beta1=0.9, ...)

   and registers ``updates[w] = w@NEW`` and one update per state var. State vars are
   zero-initialised (``program.values``), of the param's shape, dtype and split layout
   (``Var.split``, tensor parallel), named by
   `metaopt.ir.names` (``w@VELOCITY``, ``w@MOMENT1``, ``w@MOMENT2``, ``w@MAX_MOMENT2``).

It returns ``(new program, the role-optimize ops it appended)`` (clip and update ops;
the lr-sched ops are found by role). Applying a second optimizer to a program that
already has one is refused (``global_step`` exists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from metaopt.ir import Op, Program, Var, did_you_mean, names, roles, torch_dtype

LEARNING_RATE = "learning_rate"
STEP = "global_step"


def apply_optimizer(
    program: Program, *, optimizer: Any, params_grads: Sequence[tuple[str | Var, str | Var]]
) -> tuple[Program, list[Op]]:
    """Append `optimizer`'s ops for `params_grads` to a clone of `program` (see the module doc)."""
    pairs = _check(program, optimizer, params_grads)
    q = program.clone()
    schedule = optimizer.learning_rate

    # (1) step counter and learning rate
    step_new = names.new_state(STEP)
    _add(q, Var(STEP, "int64", (), "opt_state"), torch.zeros((), dtype=torch.int64))
    _add(q, Var(step_new, "int64", ()))
    q.ops.append(Op("StepCounter", [STEP], [step_new], role="lr-sched", origin=STEP))
    q.updates[STEP] = step_new
    lr0 = torch.tensor(schedule.initial_lr, dtype=torch.float64)
    _add(q, Var(LEARNING_RATE, "float64", (), "opt_state"), lr0)
    lr = LEARNING_RATE
    if schedule.op_type is not None:
        lr = names.new_state(LEARNING_RATE)
        _add(q, Var(lr, "float64", ()))
        sched_op = Op(schedule.op_type, [STEP], [lr], schedule.attrs(), role="lr-sched", origin=LEARNING_RATE)
        q.ops.append(sched_op)
        q.updates[LEARNING_RATE] = lr

    appended: list[Op] = []
    # (2) clipping by the global norm of all grads
    grads = [g for _, g in pairs]
    if optimizer.grad_clip is not None:
        clipped = [names.clipped(g) for g in grads]
        for g, c in zip(grads, clipped, strict=True):
            gv = q.vars[g]
            _add(q, Var(c, gv.dtype, gv.shape, "grad"))
        clip = optimizer.grad_clip
        op = Op(clip.op_type, list(grads), clipped, clip.attrs(), role="optimize")
        q.ops.append(op)
        appended.append(op)
        grads = clipped

    # (3) one update op per param
    op_type, attrs = optimizer.update_op_type(), optimizer.update_attrs()
    for (p, _), g in zip(pairs, grads, strict=True):
        pv = q.vars[p]
        states = list(optimizer.state_names(p).values())
        for s in states:
            # torch's initial state: zeros (a placeholder the executor fills, for a param without
            # a value: an export on the meta device); a tensor-parallel param's state is split
            # as the param is: checkpoints need it
            _add(q, Var(s, pv.dtype, pv.shape, "opt_state", split=pv.split))
            q.set_filled(s, 0.0, meta=q.is_meta(p))
        inputs = [p, g, lr] + ([step_new] if optimizer.needs_step() else []) + states
        outputs = [names.new_state(x) for x in [p, *states]]
        for x, o in zip([p, *states], outputs, strict=True):
            _add(q, Var(o, pv.dtype, pv.shape))
            q.updates[x] = o
        op = Op(op_type, inputs, outputs, dict(attrs), role="optimize", origin=p)
        q.ops.append(op)
        appended.append(op)
    return q, appended


def update_grads(p: Program) -> list[str]:
    """The grads the update-phase ops read (clipping, the updates), made before the first
    of them: what data parallel averages."""
    first = next((i for i, op in enumerate(p.ops) if roles.is_update(op.role)), len(p.ops))
    made = {o for op in p.ops[:first] for o in op.outputs if o}
    out: dict[str, None] = {}
    for op in p.ops[first:]:
        if roles.is_update(op.role):
            out.update((x, None) for x in op.inputs if x in made and p.vars[x].kind == "grad")
    return list(out)


def _add(q: Program, var: Var, value: torch.Tensor | None = None) -> None:
    if var.name in q.vars:
        raise ValueError(
            f"program {q.name!r} already has a var {var.name!r} "
            f"(an optimizer was already applied, or a var of the model has that name)"
        )
    q.add_var(var, value)


def _check(p: Program, optimizer: Any, params_grads) -> list[tuple[str, str]]:
    for attr in ("learning_rate", "grad_clip", "update_op_type", "update_attrs", "state_names"):
        if not hasattr(optimizer, attr):
            raise TypeError(
                f"optimizer must be a metaopt.optimizer.SGD/Momentum/Adam/AdamW, got {optimizer!r}"
            )
    pairs: list[tuple[str, str]] = []
    for pair in params_grads:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"params_grads entries must be (param, grad) pairs, got {pair!r}")
        pairs.append(tuple(x.name if isinstance(x, Var) else x for x in pair))  # type: ignore[arg-type]
    if not pairs:
        raise ValueError(f"params_grads is empty: no parameter of program {p.name!r} to optimize")
    params = [v.name for v in p.params(trainable_only=False)]
    seen: set[str] = set()
    for param, grad in pairs:
        if not isinstance(param, str) or not isinstance(grad, str):
            raise TypeError(f"params_grads entry ({param!r}, {grad!r}): names or Vars expected")
        if param not in p.vars:
            hint = did_you_mean(param, params)
            raise ValueError(f"params_grads: program {p.name!r} has no param {param!r}{hint}")
        pv = p.vars[param]
        if pv.kind != "param":
            hint = did_you_mean(param, params)
            raise ValueError(f"params_grads: {param!r} is not a param (kind {pv.kind}){hint}")
        if not pv.trainable:
            raise ValueError(f"params_grads: param {param!r} is frozen (trainable=False)")
        if param in seen:
            raise ValueError(f"params_grads: param {param!r} appears twice")
        seen.add(param)
        if param in p.updates:
            raise ValueError(f"params_grads: param {param!r} is already updated by {p.updates[param]!r}")
        if grad not in p.vars:
            grads = [v.name for v in p.vars.values() if not v.persistable]
            raise ValueError(
                f"params_grads: program {p.name!r} has no grad var {grad!r} (for {param!r})"
                f"{did_you_mean(grad, grads)}"
            )
        gv = p.vars[grad]
        if (gv.dtype, gv.shape) != (pv.dtype, pv.shape):
            raise ValueError(
                f"params_grads: grad {grad!r} is {gv.dtype}{list(gv.shape or [])} but param {param!r} "
                f"is {pv.dtype}{list(pv.shape or [])}"
            )
        if not torch_dtype(pv.dtype).is_floating_point:
            raise ValueError(f"params_grads: param {param!r} has dtype {pv.dtype}; updates need floats")
        if pv.shape is None or not all(isinstance(d, int) for d in pv.shape):
            raise ValueError(f"params_grads: param {param!r} has no static shape ({pv.shape})")
    return pairs

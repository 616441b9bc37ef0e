"""Optimizer in backward: each param's update runs as soon as what it reads is made and the
param is read no more, so its gradient is freed there instead of living until the backward ends.

PyTorch's optimizer-in-backward recipe (an update hook per param) as a static rewrite. In a
plain training program every gradient is alive from the op finishing it until the optimizer
runs after the whole backward; at the end of a BERT-base backward that is every param's
gradient at once. Here the update-phase ops (``optimize``, ``lr-sched``) move, in their own
order, to the earliest place where

* every input is made (the grad, after any data-parallel all-reduce; the learning rate), and
* every var they overwrite (``program.updates``: the param and its optimizer state, updated in
  place) and every var sharing its storage (views of the param the backward reads, e.g. a
  transposed weight) is read no more,

but never before the backward begins. Moved ``optimize`` ops take the role
``backward-update`` (an optimizer op in the backward phase); ``lr-sched`` ops may be anywhere.
The moves change nothing else: the same ops, the same inputs, so the step is the same
computation (bitwise on CPU) with a lower peak. One more rewrite frees a tied embedding's grad
early: its lookup grad is added row by row straight into the head's contribution
(``EmbeddingGradAccumulate``, ops/accumulate.py) instead of being made whole and then summed;
that sum rounds differently (float64 metric, not bitwise).

Refused by `fleet` (they need every grad before any update): clipping by the global norm,
gradient merge, AMP loss scaling (its overflow check reads every grad before any update may
run; bf16 without scaling is fine), pure fp16 master weights, pipeline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, roles
from metaopt.ops import accumulate, registry

MOVED_ROLE = "backward-update"


@dataclass
class Move:
    op: Op
    after: int  # index in the program of the op it now follows
    why: str  # what bounds it there


@dataclass
class UpdatePlan:
    moves: list[Move] = field(default_factory=list)
    # lookup grads added straight into the weight's other contribution (ops/accumulate.py)
    accumulations: list[accumulate.Accumulation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what stays as it was, with the reason

    def __str__(self) -> str:
        lines = [f"optimizer in backward: {len(self.moves)} update op(s) moved into the backward"]
        lines += [f"  {_short(m.op)}  after op {m.after} ({m.why})" for m in self.moves]
        lines += [
            f"  {accumulate.FUSED}({a.op.origin}) replaces ops {a.lookup} and {a.accumulate}"
            for a in self.accumulations
        ]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def _short(op: Op) -> str:
    return f"{op.type}({op.origin or ', '.join(op.inputs)})"


def _sharing(p: Program, targets: set[str]) -> dict[str, str]:
    """var -> the updated var whose storage it may share (views and pass-throughs of it)."""
    owner = {t: t for t in targets}
    for op in p.ops:
        if roles.is_update(op.role):
            continue
        pairs = registry.alias_pairs(op)
        if pairs is None:  # no row: anything may alias anything
            pairs = [(k, j) for k in range(len(op.outputs)) for j in range(len(op.inputs))]
        for k, j in pairs:
            x = op.inputs[j] if j < len(op.inputs) else ""
            o = op.outputs[k] if k < len(op.outputs) else ""
            if x in owner and o:
                owner[o] = owner[x]
    return owner


def plan_update_in_backward(p: Program) -> UpdatePlan:
    """Where each update-phase op of `p` can go (module doc)."""
    index = {id(op): i for i, op in enumerate(p.ops)}
    rest = [op for op in p.ops if not roles.is_update(op.role)]
    moved = [op for op in p.ops if roles.is_update(op.role)]
    plan = UpdatePlan()
    if not moved:
        plan.skipped.append("the program has no optimizer ops")
        return plan
    start = next((i for i, op in enumerate(rest) if roles.after_forward(op.role)), None)
    if start is None:
        plan.skipped.append("the program has no backward")
        return plan
    made = {o: i for i, op in enumerate(rest) for o in op.outputs if o}
    written = {t for op in moved for o in op.outputs for t, new in p.updates.items() if new == o}
    owner = _sharing(p, written)
    last_read: dict[str, int] = {}
    for i, op in enumerate(rest):
        for x in op.inputs:
            if x in owner:
                last_read[owner[x]] = i
    plan.accumulations, skipped = accumulate.find(p)
    plan.skipped += skipped
    placed: dict[str, int] = {}  # outputs of moved ops -> the slot they were put after
    end = len(rest) - 1
    for op in moved:
        at, why = start - 1, "the backward's start"
        for x in op.inputs:
            slot = placed.get(x, made.get(x, -1))
            if slot > at:
                at, why = slot, f"{x!r} made"
        for o in op.outputs:
            for t in (t for t, new in p.updates.items() if new == o):
                if last_read.get(t, -1) > at:
                    at, why = last_read[t], f"{t!r} last read"
        placed.update((o, at) for o in op.outputs if o)
        if at >= end:
            plan.skipped.append(f"{_short(op)}: {why} by the last op; it stays at the end")
            continue
        plan.moves.append(Move(op, index[id(rest[at])] if at >= 0 else -1, why))
    return plan


def update_in_backward(p: Program, *, plan: UpdatePlan) -> Program:
    """A clone of `p` with the plan's update ops moved and its lookup grads accumulated in
    place (one sweep, in the plan's order)."""
    q = p.clone()
    moving = {id(m.op): m.after for m in plan.moves}
    fused = {a.lookup: a.op for a in plan.accumulations}
    dropped = {a.accumulate for a in plan.accumulations}
    after: dict[int, list[Op]] = {}
    for i, op in enumerate(p.ops):
        if id(op) in moving:
            after.setdefault(moving[id(op)], []).append(_moved(q.ops[i]))
    ops = list(after.get(-1, []))
    for i, op in enumerate(p.ops):
        if id(op) not in moving:
            if i not in dropped:  # the fused op stands where the lookup's grad was
                ops.append(fused.get(i, q.ops[i]))
            ops += after.get(i, [])  # what followed a dropped op follows the fused one
    for i in fused:
        del q.vars[p.ops[i].outputs[0]]
    q.ops = ops
    return q


def _moved(op: Op) -> Op:
    return dataclasses.replace(op, role=MOVED_ROLE) if op.role == "optimize" else op

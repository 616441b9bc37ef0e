"""Overlap each bucket's collective with the ops that follow it, as DDP (and DeepSpeed's
``overlap_comm``) do.

    plan = plan_overlap_comm(program)       # the last rewrite of the grads (STEPS: after them all)
    program = apply_overlap_comm(program, plan)

Data parallel puts each bucket's ``AllReduce`` right after the op finishing its last grad. A
collective the executor waits for there holds the rest of the backward back until the bucket has
travelled. Here such an op (a row with a `wait_op`) is started there and waited for right before
the first op that reads one of its outputs, usually the optimizer's first update of them, so the
rest of the backward runs while the workers exchange the bucket::

    fc3.weight@GRAD@REDUCED = AllReduce(fc3.weight@GRAD, reduce=avg, overlap=1)    # role=comm
    ...                                            # the backward of fc2, fc1: no reader of it
    CommWait(fc3.weight@GRAD@REDUCED)                                                # role=comm
    fc3.weight@NEW = SGDUpdate(fc3.weight, fc3.weight@GRAD@REDUCED, ...)

Until its wait an output holds no value: nothing reads it before (`ops.in_flight.check_in_flight`,
which the executor runs on every program it plans too). The values are the same bits as without
the overlap (the same reduction, then the same division). The outputs are the buffer the workers
exchange, so nothing lives longer than without the overlap. On CUDA the wait makes the compute
stream wait for NCCL's; on CPU (gloo) the host waits for gloo's thread, which ran beside the ops
in between.

Not overlapped, each with its reason in the plan: a collective whose first reader is the next
op (the last of gradient merge's all-reduces, all placed before the updates), one not of role
``comm`` (AMP's found-inf sum, placed where its value is needed), one sending another dtype
(fp16_allreduce: its narrow copy would live from the start to the wait beside the outputs,
bytes the executor's accounting does not see), and the collectives of a pipeline stage program
(its phases run as separate plans: a wait in another phase than its start could not find it).
ZeRO's ``ReduceScatter`` (stage 2) sends the bucket's whole grads, which must live until its wait
(stage 2 is there to free them at once): left in flight, its rows become one more output
(``g@STAGED``, row `staged_shape`), so the executor and the memory estimate count them, and it is
waited for before the next collective starts, so at most one bucket's rows are held (DeepSpeed's
``overlap_comm`` holds a bucket or two the same way).
This runs after every pass that moves or adds readers of the reduced grads (unscaling, master
weights, updates moved into the backward), so their first reader is known. The pass is pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Var, names, roles
from metaopt.ops import registry
from metaopt.ops.in_flight import check_in_flight, is_wait
from metaopt.passes.driver import plan_text


@dataclass
class Overlap:
    start: int  # the collective's op index
    wait_before: int  # the index of its outputs' first reader (len(ops): none, the program's end)
    wait_op: str  # the row's op that finishes it
    staged: str | None = None  # the var holding what it sends until the wait (row `staged_shape`)


@dataclass
class OverlapPlan:
    overlaps: list[Overlap] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (the op's first output, why)

    def __str__(self) -> str:
        return plan_text(
            f"overlap_comm: {len(self.overlaps)} collective(s) left in flight",
            [
                f"op {o.start}: {o.wait_op} before op {o.wait_before}"
                + (f", holding {o.staged} until then" if o.staged else "")
                for o in self.overlaps
            ],
            self.skipped,
        )


def plan_overlap_comm(p: Program) -> OverlapPlan:
    """Which collectives start in flight, and before which op each is waited for."""
    plan = OverlapPlan()
    if p.pipeline is not None:
        plan.skipped += [
            (op.outputs[0], "a pipeline stage program: its phases run as separate plans")
            for op in p.ops
            if _overlappable(op) and op.outputs
        ]
        return plan
    first_reader: dict[str, int] = {}
    for i, op in enumerate(p.ops):
        for x in op.inputs:
            first_reader.setdefault(x, i)
    starts = [i for i, op in enumerate(p.ops) if _overlappable(op)]
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        if row is None or row.wait_op is None or not op.outputs:
            continue
        if op.role != "comm":
            plan.skipped.append((op.outputs[0], f"role {op.role}: placed where its value is needed"))
            continue
        if op.attrs.get("comm_dtype"):
            why = "sends another dtype: its narrow copy would live untracked until the wait"
            plan.skipped.append((op.outputs[0], why))
            continue
        if op.attrs.get("overlap"):
            plan.skipped.append((op.outputs[0], "left in flight already"))
            continue
        # SSA: an output's readers all follow its op; unread, it is waited for at the end (a fetch)
        at = min((first_reader[o] for o in op.outputs if o in first_reader), default=len(p.ops))
        # not inside a run of updates: the executor runs consecutive updates as one multi-tensor
        # call (runtime/plan.py), which a wait between them would cut; before the waits already
        # there too, so a second application finds what the first left
        if at < len(p.ops) and roles.is_update(p.ops[at].role):
            while at - 1 > i and (roles.is_update(p.ops[at - 1].role) or is_wait(p.ops[at - 1])):
                at -= 1
        if row.staged_shape is not None:  # one in flight: its rows live until the wait
            at = min([at, *(k for k in starts if k > i)])
        if at == i + 1:
            plan.skipped.append((op.outputs[0], "read by the next op: nothing to overlap"))
            continue
        staged = names.zero_staged(op.inputs[0]) if row.staged_shape is not None else None
        plan.overlaps.append(Overlap(i, at, row.wait_op, staged))
    return plan


def apply_overlap_comm(p: Program, plan: OverlapPlan) -> Program:
    """A clone of `p` whose planned collectives start in flight, each waited for before its
    outputs' first reader."""
    q = p.clone()
    started = {o.start: o for o in plan.overlaps}
    waits: dict[int, list[Op]] = {}
    ops: list[Op] = []
    for i, op in enumerate(p.ops):
        for w in waits.pop(i, []):
            ops.append(w)
        o = started.get(i)
        if o is not None:
            outs = list(op.outputs)
            if o.staged is not None:
                shape = registry.get(op.type).staged_shape(op, q.vars)
                q.add_var(Var(o.staged, q.vars[op.inputs[0]].dtype, tuple(shape), q.vars[op.inputs[0]].kind))
                outs.append(o.staged)
            op = dataclasses.replace(op, outputs=outs, attrs={**op.attrs, "overlap": 1})
            wait = Op(o.wait_op, outs, [], {}, role=op.role, origin=op.outputs[0])
            waits.setdefault(o.wait_before, []).append(wait)
        ops.append(op)
    for w in waits.pop(len(p.ops), []):
        ops.append(w)
    q.ops = ops
    check_in_flight(q)
    return q


def overlap_comm(p: Program) -> Program:
    """The one-call form: ``apply_overlap_comm(p, plan_overlap_comm(p))``."""
    return apply_overlap_comm(p, plan_overlap_comm(p))


def _overlappable(op: Op) -> bool:
    row = registry.get(op.type)
    return row is not None and row.wait_op is not None

"""Zero-bubble pipelines: a grad op that makes both input grads and weight grads, cut in two.

    plan = plan_split_weight_grads(stage_program)
    stage_program = apply_split_weight_grads(stage_program, plan)

A zero-bubble schedule runs each chunk's backward as B, the ops the grads sent to the previous
stage need, and W, the rest (passes/pipeline_phases.py). A fused grad op such as
``LinearGrad`` makes the input grad B needs and the weight and bias grads only W needs in one
op, which would take the weight-grad matmul into B, where the bubble is. Where the op's row says
``masks_outputs`` (its ``mask`` attr chooses the outputs it computes, each the same whatever
else it computes), it becomes two ops at its place::

    h@GRAD, , = LinearGrad(dy, x, w, mask=[1, 0, 0])             # role=backward: B
    , w@GRAD, b@GRAD = LinearGrad(dy, x, w, mask=[0, 1, 1])       # role=backward: W

each computing its outputs with the very kernels the fused op runs (bit for bit the same), so a
zero-bubble step equals 1F1B's. A stage program of another schedule is left as it is. Pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, roles
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry
from metaopt.passes.one_call import one_call
from metaopt.passes.pipeline_phases import needed_by_sends


@dataclass
class SplitPlan:
    program: str
    splits: dict[int, list[int]] = field(default_factory=dict)  # op index -> mask of B's outputs
    skipped: list[str] = field(default_factory=list)  # grad ops B takes whole, and why

    def __str__(self) -> str:
        lines = [
            f"split weight grads of {self.program!r}: {len(self.splits)} grad ops cut into B and W parts"
        ]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def plan_split_weight_grads(p: Program) -> SplitPlan:
    """The grad ops of `p` whose outputs B and W share (a zero-bubble stage program only)."""
    plan = SplitPlan(p.name)
    if p.pipeline is None or not p.pipeline.splits_backward:
        plan.skipped.append("not a zero-bubble pipeline stage program: its backward runs whole")
        return plan
    chunks: dict[int | None, list[int]] = {}
    for i, op in enumerate(p.ops):
        if roles.phase(op.role) == roles.BACKWARD:
            chunks.setdefault(op.stage, []).append(i)
    for idx in chunks.values():
        b, needed = needed_by_sends(p, idx)
        for i in sorted(b):
            op = p.ops[i]
            made = [k for k, o in enumerate(op.outputs) if o]
            for_b = [k for k in made if op.outputs[k] in needed]
            if "peer" in op.attrs or len(for_b) == len(made):
                continue
            row = registry.get(op.type)
            if row is None or not row.masks_outputs:
                plan.skipped.append(f"`{fmt_op(op)}`: its row cannot compute part of its outputs")
                continue
            plan.splits[i] = [int(k in for_b) for k in range(len(op.outputs))]
    return plan


def apply_split_weight_grads(p: Program, plan: SplitPlan) -> Program:
    """A clone of `p` with each planned op cut in two (see the module doc)."""
    q = p.clone()
    ops: list[Op] = []
    for i, op in enumerate(q.ops):
        if i not in plan.splits:
            ops.append(op)
            continue
        to_b = plan.splits[i]
        had = [int(bool(m)) for m in op.attrs.get("mask", [1] * len(op.outputs))]
        for part in (to_b, [h and not b for h, b in zip(had, to_b, strict=True)]):
            outs = [o if part[k] else "" for k, o in enumerate(op.outputs)]
            ops.append(
                dataclasses.replace(op, outputs=outs, attrs={**op.attrs, "mask": [int(m) for m in part]})
            )
    q.ops = ops
    return q


split_weight_grads = one_call(plan_split_weight_grads, apply_split_weight_grads)

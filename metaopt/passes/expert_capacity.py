"""Expert capacity (GShard, Megatron's ``--moe-expert-capacity-factor`` with
``--moe-pad-expert-input-to-capacity``) as a rewrite of the forward program by var name.

    plan = plan_expert_capacity(program, capacity_factor=1.25)
    print(plan)                              # each layer's capacity, which vars are slotted
    program = expert_capacity(program, plan=plan)    # then minimize(): the backward follows

Each expert of a layer serves at most ``C = ceil(capacity_factor x rows / experts)`` rows per
step (rows: tokens x k, the sorted token-expert pairs its matmuls read). Per layer,
``layout, slot_offsets, dropped = CapacityRoute(offsets, x)`` sizes the slots
(ops/kernels/moe.py); the rows (and the routing weights beside them: the same row-wise region
expert parallel moves, `find_expert_rows`) go into ``experts x C`` fixed slots by
``CapacityPack``, zero-padded, before the first expert matmul, which reads the slots' offsets;
``CapacityUnpack`` puts them back after the last row-wise op. A row past its expert's capacity
is dropped: its expert output is zero (the token keeps its other experts' and the residual),
its grad zero.

The shapes between the two no longer depend on the routing: ``experts x C`` rows, C written in
the dims (``(5*(24*batch)+3)//4``), so `estimate_memory` is exact and a CUDA graph can replay
the step. Dropped rows are never silent: each layer's count is summed into the program output
``moe_dropped_tokens`` (fetch it), and the ``metaopt.moe`` logger warns at the 1st, 10th,
100th ... step a layer drops rows. ``capacity_factor`` >= experts never drops a row.

The pass is pure and runs on the forward program, before append_backward; not beside expert
parallel yet (refused by fleet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Var, names
from metaopt.ops.kernels.moe import capacity_of, capacity_ratio
from metaopt.passes.expert_parallel import ExpertParallelError, ExpertRows, find_expert_rows, move_rows


class ExpertCapacityError(ExpertParallelError):
    pass


@dataclass
class CapacityPlan(ExpertRows):
    capacity_factor: float = 1.0
    capacity_dims: dict = field(default_factory=dict)  # offsets -> C as a dim (int or expression)

    def __str__(self) -> str:
        lines = [
            f"expert capacity plan: capacity_factor={self.capacity_factor:g}, {len(self.routes)} MoE layer(s)"
        ]
        for offsets, at in self.routes.items():
            lines.append(
                f"  layer of {offsets}: capacity {self._capacity_text(offsets)} rows per expert (op {at})"
            )
        lines += [f"  {m}" for m in self.moves]
        if self.routes:
            lines.append(f"  rows dropped at capacity: summed into {names.moe_dropped_tokens()!r} (fetch it)")
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)

    def _capacity_text(self, offsets: str) -> str:
        return str(self.capacity_dims.get(offsets, "?"))


def plan_expert_capacity(p: Program, *, capacity_factor: float) -> CapacityPlan:
    """Each layer's capacity and which values take slots (module doc); nothing is rewritten."""
    if (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not capacity_factor > 0
    ):
        raise ExpertCapacityError(
            f"expert capacity: capacity_factor must be a number > 0, got {capacity_factor!r}"
        )
    plan = CapacityPlan(
        capacity_factor=float(capacity_factor),
        what="expert capacity",
        out_text="into its experts' fixed slots",
        back_text="back out of the slots",
    )
    find_expert_rows(p, plan)
    if not plan.routes:
        plan.skipped.append("no expert layer (GroupedMatMul): nothing to give a capacity")
    for offsets, x in plan.route_x.items():
        plan.capacity_dims[offsets] = _capacity_dim(
            capacity_factor, p.vars[x].shape[0], p.vars[offsets].shape[0]
        )
    if names.moe_dropped_tokens() in p.vars:
        raise ExpertCapacityError(
            f"expert capacity: {names.moe_dropped_tokens()!r} exists already: applied twice?"
        )
    return plan


def _capacity_dim(capacity_factor: float, rows, experts: int):  # noqa: ANN001, ANN202 - Dims
    """`capacity_of` as a dim: an int for static rows, else the same expression over the dims."""
    if isinstance(rows, int):
        return capacity_of(capacity_factor, rows, experts)
    num, den = capacity_ratio(capacity_factor)
    return f"({num}*({rows})+{den * experts - 1})//{den * experts}"


def expert_capacity(p: Program, *, plan: CapacityPlan) -> Program:
    """A copy of `p` with `plan`'s slots (module doc)."""
    q = p.clone()

    def route(ops: list[Op], offsets: str) -> tuple[str, str, str]:
        return _route(q, ops, offsets, plan)

    def move(ops: list[Op], x: str, layout: str, offsets: str, back: bool) -> str:
        return _move(q, ops, x, layout, plan, offsets, back=back)

    # the last layer's first expert matmul: the count of every layer is made by then
    last = q.ops[max(plan.routes.values())] if plan.routes else None
    routed = move_rows(q, plan, route=route, move=move, rows_of=lambda offsets: _slots(q, plan, offsets))
    if routed:
        total = names.moe_dropped_tokens()
        q.add_var(Var(total, "int64", ()))
        at = next(k for k, op in enumerate(q.ops) if op is last)
        q.ops.insert(at, Op("Sum", [d for _, _, d in routed.values()], [total], role="forward", scope=""))
        q.outputs = [*q.outputs, total]
    return q


def _slots(q: Program, plan: CapacityPlan, offsets: str):  # noqa: ANN202 - a Dim
    experts = q.vars[offsets].shape[0]
    cap = plan.capacity_dims[offsets]
    return experts * cap if isinstance(cap, int) else f"{experts}*({cap})"


def _route(q: Program, ops: list[Op], offsets: str, plan: CapacityPlan) -> tuple[str, str, str]:
    experts = q.vars[offsets].shape[0]
    layout = names.fresh(names.capacity_layout(offsets), q.vars)
    q.add_var(Var(layout, "int64", (4 + experts,)))
    slots = names.fresh(names.capacity_offsets(offsets), q.vars)
    q.add_var(Var(slots, q.vars[offsets].dtype, (experts,)))
    dropped = names.fresh(names.capacity_dropped(offsets), q.vars)
    q.add_var(Var(dropped, "int64", ()))
    scope = next((op.scope for op in q.ops if offsets in op.outputs), "")
    ops.append(
        Op(
            "CapacityRoute",
            [offsets, plan.route_x[offsets]],
            [layout, slots, dropped],
            {"capacity_factor": plan.capacity_factor},
            scope=scope,
            origin=offsets,
        )
    )
    return layout, slots, dropped


def _move(
    q: Program, ops: list[Op], x: str, layout: str, plan: CapacityPlan, offsets: str, *, back: bool
) -> str:
    v = q.vars[x]
    y = names.fresh((names.capacity_unpacked if back else names.capacity_packed)(x), q.vars)
    rows = q.vars[plan.route_x[offsets]].shape[0] if back else _slots(q, plan, offsets)
    q.add_var(Var(y, v.dtype, (rows, *v.shape[1:])))
    scope = next((op.scope for op in q.ops if x in op.outputs), "")
    ops.append(Op("CapacityUnpack" if back else "CapacityPack", [x, layout], [y], scope=scope, origin=x))
    return y

"""Expert parallel as a rewrite of the forward program by var name (DeepSpeed-MoE, Megatron-Core's
EP, Paddle's ``ep_degree``).

    plan = plan_expert_parallel(program, ep_degree=2, ep_rank=rank, group=[0, 1])
    print(plan)                        # which expert params split, where rows travel
    program = expert_parallel(program, plan=plan)   # then minimize(): the backward follows

* Every op whose row has ``expert_inputs`` (``GroupedMatMul(x, w, offsets)``, HF's grouped
  experts, ops/kernels/moe.py) is an expert layer: its weight traced back through ops whose split
  rules keep dim 0 where it is (the Transposes to [E, K, N]) is an expert param [E, ...].
  Worker ``r`` of the group keeps experts ``r*E/ep .. (r+1)*E/ep - 1`` of it (the var's `Split`
  has ``group="expert"``); E not divisible by ep, or an expert param read by anything else, is
  refused naming the op's printed line.
* Per ``offsets`` var (one MoE layer), ``layout, local_offsets = ExpertRoute(offsets, x)``
  trades the row counts once (ops/kernels/expert_parallel.py); the layer's GroupedMatMuls read
  ``local_offsets``.
* Rows sorted by expert are "global" (this worker's tokens) or "local" (the rows this worker's
  experts serve, from every worker). A GroupedMatMul makes local rows; a global input it reads
  is dispatched first (``ExpertExchange``). An op reading local rows passes them on when its
  split rule (ops/sharding.py) carries a split along dim 0 unchanged (the activation between the
  two matmuls, the routing weights' product): its other row-aligned inputs are dispatched too.
  Any other reader gets them combined back (``ExpertExchange(reverse=1)``) first. So the rows
  travel out once before the first matmul and back once after the last row-wise op.
* A local value's dim 0 is written as its bound, every row of every worker of the group
  (``ep*(n)``): `estimate_memory` predicts the worst routing (all k x tokens to one worker).
  Where the offsets give every expert the same rows (expert capacity's slots, a row's
  ``equal_runs``) each worker receives exactly the rows it sends (``n``: experts x capacity), and
  the shapes, the estimate and the traffic are exact.
* Random ops on local rows (dropout inside the experts) are refused: their mask would differ
  from one process's.

The pass is pure and runs on the forward program, before append_backward: the backward comes
from ExpertExchange's gradient rule (the exchange the other way). The expert params' grads are
then this worker's own experts' over every token the group sent them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Split, Var, names, torch_dtype
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry, sharding
from metaopt.ops.sharding import Shard, ShardArgs

GROUP = "expert"


class ExpertParallelError(ValueError):
    pass


@dataclass
class ExpertRows:
    """Where an expert layer's rows live (`find_expert_rows`): shared by the passes that move
    them (expert parallel: to other workers; expert capacity: into fixed-size slots)."""

    routes: dict[str, int] = field(default_factory=dict)  # offsets var -> the op index routed before
    route_x: dict[str, str] = field(default_factory=dict)  # offsets var -> the rows the route sizes by
    offsets_of: dict[int, str] = field(default_factory=dict)  # expert matmul index -> its offsets var
    local: dict[str, str] = field(default_factory=dict)  # var on moved rows -> its offsets var
    dispatch: dict[int, list[int]] = field(default_factory=dict)  # op -> input positions moved out
    combine: dict[int, list[int]] = field(default_factory=dict)  # op -> input positions moved back
    moves: list[str] = field(default_factory=list)  # what moves where, in program order (printed)
    skipped: list[str] = field(default_factory=list)
    what: str = "expert parallel"  # the pass, in errors
    out_text: str = "to its experts' workers"
    back_text: str = "back to the workers that routed it"


@dataclass
class ExpertParallelPlan(ExpertRows):
    ep_degree: int = 1
    ep_rank: int = 0
    group: list[int] | str = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)  # expert param -> its E
    # layers whose offsets give every expert the same rows (capacity slots): exact, not bound
    equal: set[str] = field(default_factory=set)
    views: dict[str, int] = field(default_factory=dict)  # Transposes of them -> E
    # bytes a worker's exchanges may send per step, a dim expression (`traffic`; not the program
    # itself: holding it would keep the whole expert params alive beside the cut ones)
    all_to_all_bytes: str = "0"

    def traffic(self, p: Program) -> str:
        """The bytes a worker's exchanges may send to the others per step, as a dim expression:
        every row of each dispatched var (this worker's tokens) and of each combined one (at its
        bound), in the forward, and as many in the backward (the grads go back the same ways),
        plus each layer's row counts (the share for other workers: (ep-1)/ep). Each var counted
        once per way (`move_rows` moves it once, whatever reads it). Exact for a layer with equal
        runs (capacity slots): the (ep-1)/ep of its rows that leave the worker, where every moved
        var has a grad and nothing recomputes the exchanges (recompute sends them again)."""
        ep, terms, seen = self.ep_degree, [], set()

        def add(x: str, offsets: str) -> None:
            if (x, x in self.local) in seen:
                return
            seen.add((x, x in self.local))
            v = p.vars[x]
            rows = v.shape[0] if x not in self.local else _bound_of(self, p, offsets)
            row_bytes = math.prod(v.shape[1:]) * torch_dtype(v.dtype).itemsize
            share = f"*{ep - 1}//{ep}" if offsets in self.equal else ""
            terms.append(f"({rows})*{row_bytes}{share}")

        for i, js in self.dispatch.items():
            op = p.ops[i]
            offsets = self.offsets_of.get(i) or next(self.local[y] for y in op.inputs if y in self.local)
            for j in js:
                add(op.inputs[j], offsets)
        for i, js in self.combine.items():
            for j in js:
                add(p.ops[i].inputs[j], self.local[p.ops[i].inputs[j]])
        counts = sum(p.vars[o].shape[0] * 8 for o in self.routes) * (ep - 1) // ep  # ExpertRoute's, once
        return f"2*({' + '.join(terms)}) + {counts}" if terms else "0"

    def __str__(self) -> str:
        lines = [
            f"expert parallel plan: ep_degree={self.ep_degree}, rank {self.ep_rank} of group {self.group}, "
            f"{len(self.routes)} MoE layer(s)"
        ]
        for w, e in self.params.items():
            n = e // self.ep_degree
            lines.append(f"  split  {w}: experts {self.ep_rank * n}..{(self.ep_rank + 1) * n - 1} of {e}")
        lines += [f"  {m}" for m in self.moves]
        if self.routes:
            lines.append(f"  all-to-all bytes per step, at most: {self.all_to_all_bytes}")
        if set(self.routes) - self.equal:
            lines.append(
                "  rows an expert layer receives: data (the routing); shapes and estimate_memory use their "
                f"bound, every row of the {self.ep_degree} workers (all tokens to this worker's experts)"
            )
        if self.equal:
            lines.append(
                f"  rows {len(self.equal)} layer(s) receive: exact, their experts' fixed slots (as many "
                "as each worker sends)"
            )
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def plan_expert_parallel(
    p: Program, *, ep_degree: int, ep_rank: int, group: Sequence[int] | str
) -> ExpertParallelPlan:
    """Which expert params split and where rows travel (module doc); nothing is rewritten."""
    if not isinstance(ep_degree, int) or ep_degree < 1 or not 0 <= ep_rank < ep_degree:
        raise ExpertParallelError(f"expert parallel: ep_rank {ep_rank} must be in [0, ep_degree={ep_degree})")
    if not isinstance(group, str) and len(group) != ep_degree:
        raise ExpertParallelError(
            f"expert parallel: group {list(group)} must have ep_degree={ep_degree} ranks"
        )
    plan = ExpertParallelPlan(
        ep_degree=ep_degree, ep_rank=ep_rank, group=group if isinstance(group, str) else list(group)
    )
    producer = {o: i for i, op in enumerate(p.ops) for o in op.outputs if o}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(p.ops):
        for x in op.inputs:
            if x:
                readers.setdefault(x, []).append(i)
    matmuls = [i for i, op in enumerate(p.ops) if _expert_inputs(op) is not None]
    if not matmuls:
        plan.skipped.append("no expert layer (GroupedMatMul): the program has no experts to split")
        return plan
    for i in matmuls:
        _plan_weight(p, plan, i, producer, readers)
    find_expert_rows(p, plan)
    plan.equal = {o for o in plan.routes if o in producer and _equal_runs(p.ops[producer[o]], o)}
    plan.all_to_all_bytes = plan.traffic(p)
    return plan


def _equal_runs(op: Op, offsets: str) -> bool:
    row = registry.get(op.type)
    return row is not None and row.equal_runs is not None and op.outputs.index(offsets) == row.equal_runs


def find_expert_rows(p: Program, rows: ExpertRows) -> None:
    """Fill `rows`: each expert layer's offsets and the rows its matmuls read, then, op by op,
    which values live on moved rows, which inputs move out and which come back (module doc)."""
    for i, op in enumerate(p.ops):
        at = _expert_inputs(op)
        if at is None:
            continue
        offsets = op.inputs[at[2]]
        if not isinstance((p.vars[offsets].shape or (None,))[0], int):
            raise ExpertParallelError(f"{rows.what}: `{fmt_op(op)}`: its offsets' length is not static")
        rows.offsets_of[i] = offsets
        if offsets not in rows.routes:
            rows.routes[offsets] = i
            rows.route_x[offsets] = op.inputs[at[0]]
    for i, op in enumerate(p.ops):
        _plan_op(p, rows, i, op)
    leaving = [x for x in [*p.outputs, p.loss_name] if x in rows.local]
    if leaving:
        raise ExpertParallelError(f"{rows.what}: {leaving} on moved expert rows reach the program's outputs")


def _expert_inputs(op: Op) -> tuple[int, int, int] | None:
    row = registry.get(op.type)
    return None if row is None else row.expert_inputs


def _plan_weight(p: Program, plan: ExpertParallelPlan, i: int, producer: dict, readers: dict) -> None:
    op = p.ops[i]
    _, at_w, at_offsets = _expert_inputs(op)
    offsets = op.inputs[at_offsets]
    experts = (p.vars[offsets].shape or (None,))[0]
    if not isinstance(experts, int):
        raise ExpertParallelError(f"expert parallel: `{fmt_op(op)}`: its offsets' length is not static")
    if experts % plan.ep_degree:
        raise ExpertParallelError(
            f"expert parallel: `{fmt_op(op)}`: {experts} experts do not split over ep_degree={plan.ep_degree}"
        )
    w, chain = op.inputs[at_w], []
    while w in producer and p.vars[w].kind != "param":
        t = p.ops[producer[w]]
        if not _keeps_dim0(p, t):
            raise ExpertParallelError(
                f"expert parallel: `{fmt_op(t)}` makes expert weight {op.inputs[at_w]!r} but does not keep "
                "its expert dim first"
            )
        chain.append(w)
        w = t.inputs[0]
    v = p.vars[w]
    if v.kind != "param" or (v.shape or (None,))[0] != experts:
        raise ExpertParallelError(
            f"expert parallel: `{fmt_op(op)}`: its weight is not a param [{experts}, ...] "
            f"(traced back to {w!r}, a {v.kind} of shape {list(v.shape or [])})"
        )
    for x in [w, *chain]:
        others = [r for r in readers.get(x, []) if r != i and p.ops[r].outputs[0] not in chain]
        if others:
            raise ExpertParallelError(
                f"expert parallel: expert param {w!r} is read outside its experts' matmul by "
                f"`{fmt_op(p.ops[others[0]])}`"
            )
    plan.params[w] = experts
    plan.views.update({c: experts for c in chain})


def _keeps_dim0(p: Program, op: Op) -> bool:
    """Whether `op`, of one run-time input, carries a split of it along dim 0 to its output's
    dim 0, as its split rule says (a Transpose of an expert weight that leaves the expert dim
    first, a cast of it)."""
    runtime = [j for j, x in enumerate(op.inputs) if x and p.vars[x].kind != "constant"]
    return (
        runtime == [0]
        and len(op.outputs) == 1
        and _row_wise(p, op, [0], (p.vars[op.inputs[0]].shape or (None,))[0])
    )


def _plan_op(p: Program, plan: ExpertRows, i: int, op: Op) -> None:
    if i in plan.offsets_of:
        at_x = _expert_inputs(op)[0]
        x = op.inputs[at_x]
        if x not in plan.local:
            plan.dispatch[i] = [at_x]
            plan.moves.append(f"dispatch {_typed(p, x)} {plan.out_text} (op {i}, {op.type})")
        plan.local[op.outputs[0]] = plan.offsets_of[i]
        return
    locals_in = [j for j, x in enumerate(op.inputs) if x in plan.local]
    if not locals_in:
        return
    offsets = plan.local[op.inputs[locals_in[0]]]
    rows = p.vars[plan.route_x[offsets]].shape[0]
    aligned = [
        j
        for j, x in enumerate(op.inputs)
        if x and (p.vars[x].shape or ())[:1] == (rows,) and len(p.vars[x].shape) > 1 or j in locals_in
    ]
    if _row_wise(p, op, aligned, rows):
        if (registry.get(op.type) or registry.OpDef(op.type, None)).random:
            raise ExpertParallelError(
                f"{plan.what}: `{fmt_op(op)}` draws random numbers on moved expert rows (dropout inside "
                "the experts): its mask would differ from the program's"
            )
        extra = [j for j in aligned if j not in locals_in]
        if extra:
            plan.dispatch[i] = extra
            for j in extra:
                plan.moves.append(
                    f"dispatch {_typed(p, op.inputs[j])} beside the expert rows (op {i}, {op.type})"
                )
        plan.local.update({o: offsets for o in op.outputs if o and (p.vars[o].shape or ())[:1] == (rows,)})
        return
    plan.combine[i] = locals_in
    for j in locals_in:
        plan.moves.append(f"combine  {_typed(p, op.inputs[j])} {plan.back_text} (op {i}, {op.type})")


def _typed(p: Program, name: str) -> str:
    v = p.vars[name]
    return f"{name}: {v.dtype}[{', '.join(map(str, v.shape or ()))}]"


def _row_wise(p: Program, op: Op, aligned: list[int], rows) -> bool:  # noqa: ANN001 - a Dim
    """Whether `op` carries a split of its row-aligned inputs along dim 0 through unchanged, as
    its split rule says (probed with a static stand-in for the rows)."""
    rule = sharding.rule(op.type)
    if rule is None:
        return False
    stand_in = 4

    def concrete(name: str) -> tuple | None:
        shape = p.vars[name].shape if name else None
        if shape is None:
            return None
        shape = tuple(shape)
        if shape[:1] == (rows,):
            shape = (stand_in, *shape[1:])
        return shape if all(isinstance(d, int) for d in shape) else None

    shapes = [concrete(x) for x in op.inputs]
    outs = [concrete(o) for o in op.outputs]
    if any(shapes[j] is None for j in aligned):
        return False
    args = ShardArgs(
        op=op,
        shards=[Shard(0, (stand_in,)) if j in aligned else None for j in range(len(op.inputs))],
        shapes=shapes,
        out_shapes=outs,
        mp=2,
        constant=lambda name: None,
    )
    try:
        res = rule.propagate(args)
    except (sharding.ShardRefused, sharding.ShardNotImplemented, ValueError, TypeError, KeyError):
        return False
    return (
        not res.constants
        and not res.attrs
        and all(s is not None and s.axis == 0 for s, o in zip(res.outputs, outs) if o is not None)
    )


def expert_parallel(p: Program, *, plan: ExpertParallelPlan) -> Program:
    """A copy of `p` rewritten for `plan`'s worker: expert params cut to its experts, rows
    dispatched and combined, local shapes at their bound (module doc)."""
    q = p.clone()
    ep, rank = plan.ep_degree, plan.ep_rank
    for w, experts in plan.params.items():
        n = experts // ep
        if w in q.values:
            q.values[w] = q.values[w][rank * n : (rank + 1) * n].clone()
        v = q.vars[w]
        v.shape = (n, *v.shape[1:])
        v.split = Split(0, ep, (experts,), GROUP)
    for c, experts in plan.views.items():
        q.vars[c].shape = (experts // ep, *q.vars[c].shape[1:])

    def route(ops: list[Op], offsets: str) -> tuple[str, str]:
        return _route(q, ops, offsets, plan.route_x[offsets], plan.group, ep)

    def move(ops: list[Op], x: str, layout: str, offsets: str, back: bool) -> str:
        return _exchange(q, ops, x, layout, plan, int(back), offsets)

    move_rows(q, plan, route=route, move=move, rows_of=lambda offsets: _bound(q, plan, offsets))
    return q


def move_rows(q: Program, rows: ExpertRows, *, route, move, rows_of) -> dict[str, tuple]:  # noqa: ANN001
    """The one sweep of the passes that move expert rows, in place on `q` (their clone): before
    each layer's first expert matmul ``route(ops, offsets) -> (layout, new offsets, ...)`` appends
    its op; each input `rows` says moves out (back) is replaced by ``move(ops, x, layout, offsets,
    back)`` (once per var and way); the expert matmuls read the new offsets, and every value on
    moved rows gets ``rows_of(offsets)`` rows. Returns each layer's route results, by offsets."""
    routed: dict[str, tuple] = {}
    moved: dict[tuple[str, bool], str] = {}
    ops: list[Op] = []

    def moved_var(x: str, offsets: str, back: bool) -> str:
        if (x, back) not in moved:
            moved[(x, back)] = move(ops, x, routed[offsets][0], offsets, back)
        return moved[(x, back)]

    for i, op in enumerate(q.ops):
        for offsets, at in rows.routes.items():
            if at == i:
                routed[offsets] = route(ops, offsets)
        for j in rows.dispatch.get(i, []):
            offsets = rows.offsets_of.get(i) or next(rows.local[x] for x in op.inputs if x in rows.local)
            op.inputs[j] = moved_var(op.inputs[j], offsets, back=False)
        for j in rows.combine.get(i, []):
            op.inputs[j] = moved_var(op.inputs[j], rows.local[op.inputs[j]], back=True)
        if i in rows.offsets_of:
            op.inputs[_expert_inputs(op)[2]] = routed[rows.offsets_of[i]][1]
        for o in op.outputs:
            if o in rows.local:
                q.vars[o].shape = (rows_of(rows.local[o]), *q.vars[o].shape[1:])
        ops.append(op)
    q.ops = ops
    return routed


def _bound(q: Program, plan: ExpertParallelPlan, offsets: str):  # noqa: ANN202 - a Dim
    return _bound_of(plan, q, offsets)


def _bound_of(plan: ExpertParallelPlan, q: Program, offsets: str):  # noqa: ANN202 - a Dim
    """Rows an expert layer may receive: every row of every worker of the group; exactly a
    worker's own where every expert has the same rows (each then receives what it sends)."""
    n = q.vars[plan.route_x[offsets]].shape[0]
    if offsets in plan.equal:
        return n
    return plan.ep_degree * n if isinstance(n, int) else f"{plan.ep_degree}*({n})"


def _route(q: Program, ops: list[Op], offsets: str, x: str, group, ep: int) -> tuple[str, str]:  # noqa: ANN001
    experts = q.vars[offsets].shape[0]
    layout = names.fresh(names.ep_layout(offsets), q.vars)
    q.add_var(Var(layout, "int64", (3 + 2 * experts,)))
    local = names.fresh(names.ep_offsets(offsets), q.vars)
    q.add_var(Var(local, q.vars[offsets].dtype, (experts // ep,)))
    scope = _scope(q, offsets)
    ops.append(
        Op("ExpertRoute", [offsets, x], [layout, local], {"group": group}, scope=scope, origin=offsets)
    )
    return layout, local


def _exchange(
    q: Program, ops: list[Op], x: str, layout: str, plan: ExpertParallelPlan, reverse: int, offsets: str
) -> str:
    v = q.vars[x]
    y = names.fresh((names.ep_combined if reverse else names.ep_dispatched)(x), q.vars)
    rows = q.vars[plan.route_x[offsets]].shape[0] if reverse else _bound(q, plan, offsets)
    q.add_var(Var(y, v.dtype, (rows, *v.shape[1:])))
    attrs = {"group": plan.group, "reverse": reverse}
    ops.append(Op("ExpertExchange", [x, layout], [y], attrs, scope=_scope(q, x), origin=x))
    return y


def _scope(q: Program, var: str) -> str:
    return next((op.scope for op in q.ops if var in op.outputs), "")

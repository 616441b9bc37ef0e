"""Sequence parallel's backward gathers again instead of holding (Megatron: a column-parallel
layer under sequence parallel saves its input's sequence chunk and all-gathers it again for its
weight grad).

    plan = plan_regather(program)   # after append_backward (and recompute, if any)
    print(plan)
    program = regather(program, plan=plan)

Requires: a training program whose forward has sequence parallel's ``SPGather`` ops (rows with
``sequence="gather"``). Ensures: no backward op reads a gathered (whole-sequence) value of the
forward, nor a view of one (the reshape to a Gemm's rows) or a cast of one (AMP's low-precision
copy a column layer reads: rows with ``sequence="remake"``): right before the first backward op
reading one, the gather, its views and casts are re-emitted (role ``recompute``, outputs
``names.recompute``) from the sequence chunk, which the forward holds anyway, and the backward
reads those. The forward's whole value then dies at its last forward reader: the regions'
activations held for the backward are 1/mp of tensor parallel's, as Korthikanti et al. count them.
The cost is one more all-gather per column-parallel input per step, in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Var, names, roles
from metaopt.ops import sharding


@dataclass(frozen=True)
class Regather:
    chain: tuple[int, ...]  # the forward SPGather and the views of its output, in program order
    first: int  # the first backward op reading any of them
    readers: tuple[int, ...]  # the backward ops reading them


@dataclass
class RegatherPlan:
    items: list[Regather] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"sp_regather: {len(self.items)} gathered values all-gathered again for the backward"
        return "\n".join([head, *(f"  {e}" for e in self.events), *(f"  skipped  {s}" for s in self.skipped)])


def plan_regather(p: Program) -> RegatherPlan:
    """Which gathered values (and views of them) the backward reads (module doc)."""
    plan = RegatherPlan()
    consumers = p.consumers()
    for i, op in enumerate(p.ops):
        if sharding.sequence_kind(op) != "gather" or not roles.is_forward(op.role):
            continue
        chain, values = [i], [op.outputs[0]]
        for v in values:  # the forward views and casts of the gathered value, breadth first
            for k in consumers.get(v, []):
                view = p.ops[k]
                one = len(view.outputs) == 1  # a Split's other pieces would not be re-made
                cheap = sharding.is_view(view) or sharding.sequence_kind(view) == "remake"
                if roles.is_forward(view.role) and cheap and one and view.inputs[0] == v:
                    chain.append(k)
                    values.append(view.outputs[0])
        readers = sorted(
            {k for v in values for k in consumers.get(v, []) if roles.is_backward(p.ops[k].role)}
        )
        if not readers:
            plan.skipped.append(f"{op.outputs[0]}: no backward op reads it (or a view of it)")
            continue
        plan.items.append(Regather(_needed(p, chain, readers), readers[0], tuple(readers)))
        plan.events.append(
            f"regather {op.outputs[0]}: from {op.inputs[0]} before `{p.ops[readers[0]].type}` "
            f"({len(readers)} backward readers; {len(_needed(p, chain, readers)) - 1} views / casts re-made)"
        )
    return plan


def _needed(p: Program, chain: list[int], readers: list[int]) -> tuple[int, ...]:
    """The ops of `chain` the backward `readers` need, in program order: a view or cast no
    backward op reads (directly or through a later one of the chain) is not made again (a cast
    would be a whole-sequence buffer for nothing)."""
    wanted = {x for k in readers for x in p.ops[k].inputs if x}
    kept = []
    for k in sorted(chain, reverse=True):
        if p.ops[k].outputs[0] in wanted:
            kept.append(k)
            wanted.add(p.ops[k].inputs[0])
    return tuple(sorted(kept))


def regather(p: Program, *, plan: RegatherPlan) -> Program:
    """A copy of `p` whose backward reads gathered values it gathers itself (module doc)."""
    q = p.clone()
    before: dict[int, list[Op]] = {}
    renames: dict[int, dict[str, str]] = {}
    for item in plan.items:
        new: dict[str, str] = {}
        ops = []
        for k in item.chain:
            op = p.ops[k]
            out = op.outputs[0]
            new[out] = names.fresh(names.recompute(out), q.vars)
            v = q.vars[out]
            q.add_var(Var(new[out], v.dtype, v.shape))
            ins = [new.get(x, x) for x in op.inputs]
            kw = {"role": "recompute", "scope": op.scope, "origin": out}
            ops.append(Op(op.type, ins, [new[out]], dict(op.attrs), **kw))
        before.setdefault(item.first, []).extend(ops)
        for k in item.readers:
            renames.setdefault(k, {}).update(new)
    out_ops: list[Op] = []
    for i, op in enumerate(q.ops):
        out_ops += before.get(i, [])
        if i in renames:
            op.inputs = [renames[i].get(x, x) if x else x for x in op.inputs]
        out_ops.append(op)
    q.ops = out_ops
    return q

"""``tensor_parallel_configs = {"column": "auto", "row": "auto"}``: find the column- and
row-parallel Linear layers of standard transformer blocks, so a user need not name them.

    auto = auto_layers(program, mp_degree=2)
    print(auto)                 # which layers split, which stay replicated and why
    plan = plan_tensor_parallel(program, ..., column=auto.column, row=auto.row)

Megatron's blocks are pairs: a column-parallel Linear (or several: q, k and v; gate and up)
whose split output flows through ops that carry a split (metaopt/ops/sharding.py's rules:
elementwise ops, reshapes to heads, attention over heads) into a row-parallel Linear that ends
it. So, for every Linear, its *region* is what its output reaches through ops with a split rule,
stopping at the Linears that read a value of the region (the region's ends). Linears whose
regions meet (q·kᵀ reads q's and k's) form one block. A block is split when its region never
leaves through an op without a rule or a program output, and `plan_tensor_parallel` accepts it
(head counts and sizes divisible by mp_degree, ...); otherwise its Linears stay replicated and
`skipped` says why (e.g. a LLaMA block whose rotary embedding has no split rule, the LM head,
whose output reaches the loss). Blocks are taken in program order; a Linear already used as an
end of an earlier block is not a start of a later one (GPT-2's c_proj ends attention; its own
region would reach the next LayerNorm, which has no rule).

The result is a list of var names (each Linear's output), which is what the column/row
patterns resolve to; the pure planner then does the rest exactly as with hand-named layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metaopt.ir import Program
from metaopt.ir.printer import fmt_op
from metaopt.ops import sharding


@dataclass
class AutoLayers:
    column: list[str] = field(default_factory=list)  # Linear outputs (their module paths)
    row: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # Linears left replicated, with the reason

    def __str__(self) -> str:
        head = f"tensor_parallel auto: {len(self.column)} column and {len(self.row)} row layers"
        return "\n".join(
            [
                head,
                *(f"  column   {c}" for c in self.column),
                *(f"  row      {r}" for r in self.row),
                *(f"  skipped  {s}" for s in self.skipped),
            ]
        )


@dataclass
class _Region:
    start: int  # the Linear op whose output starts it
    ops: set[int] = field(default_factory=set)  # ops the split passes through
    ends: set[int] = field(default_factory=set)  # Linear ops reading a value of the region
    stop: str = ""  # why the split cannot stay inside (empty: it can)


def auto_layers(p: Program, *, mp_degree: int, mp_rank: int = 0) -> AutoLayers:
    """The column / row layers of `p`'s transformer blocks that split over `mp_degree` ranks
    (module doc); every other Linear is listed in `skipped` with the reason."""
    from metaopt.passes.tensor_parallel import TensorParallelError, plan_tensor_parallel

    linears = [i for i, op in enumerate(p.ops) if sharding.linear_parts(op) is not None]
    consumers = p.consumers()  # once: a region per Linear walks it (80 layers: 560 Linears)
    regions = {i: _region(p, i, consumers) for i in linears}
    out = AutoLayers()
    used: set[int] = set()
    for block in _blocks(linears, regions):
        if used & block:
            continue
        starts = sorted(block)
        stop = next((regions[i].stop for i in starts if regions[i].stop), "")
        ends = sorted(set().union(*(regions[i].ends for i in starts)) - block)
        if not stop and not ends:
            stop = "no Linear ends its split"
        if not stop:
            try:
                plan_tensor_parallel(
                    p,
                    mp_degree=mp_degree,
                    mp_rank=mp_rank,
                    column=[*out.column, *(_name(p, i) for i in starts)],
                    row=[*out.row, *(_name(p, i) for i in ends)],
                    group=list(range(mp_degree)),
                )
            except (TensorParallelError, NotImplementedError) as e:
                stop = str(e)
        if stop:
            if not any(i in used for i in starts):
                out.skipped.append(f"{', '.join(_name(p, i) for i in starts)}: {stop}")
            continue
        out.column += [_name(p, i) for i in starts]
        out.row += [_name(p, i) for i in ends]
        used |= block | set(ends)
    return out


def _name(p: Program, i: int) -> str:
    return p.ops[i].outputs[0]


def _region(p: Program, start: int, consumers: dict[str, list[int]]) -> _Region:
    """Where `start`'s output flows through ops that carry a split (module doc)."""
    region = _Region(start)
    leaving = {*p.outputs, p.loss_name}
    todo, seen = [p.ops[start].outputs[0]], set()
    while todo and not region.stop:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in leaving:
            region.stop = f"its split would reach the program output {v!r}"
            break
        for j in consumers.get(v, []):
            op = p.ops[j]
            parts = sharding.linear_parts(op)
            if parts is not None and parts[0] == v:
                region.ends.add(j)
                continue
            if parts is not None or sharding.rule(op.type) is None:
                region.stop = f"its split would pass through `{fmt_op(op)}`, which cannot carry it"
                break
            region.ops.add(j)
            todo.extend(o for o in op.outputs if o)
    return region


def _blocks(linears: list[int], regions: dict[int, _Region]) -> list[set[int]]:
    """Linears whose regions share an op, grouped (union-find), in program order of their first."""
    parent = {i: i for i in linears}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i in linears:
        for j in regions[i].ops:
            if j in owner:
                parent[find(i)] = find(owner[j])
            else:
                owner[j] = i
    groups: dict[int, set[int]] = {}
    for i in linears:
        groups.setdefault(find(i), set()).add(i)
    return sorted(groups.values(), key=min)

"""Tensor (model) parallel with Megatron's semantics, as a rewrite of the forward program by var name.

    plan = plan_tensor_parallel(program, mp_degree=2, mp_rank=rank, group=[0, 1],
                                column=["transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc"],
                                row=["transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"])
    print(plan)                      # which params split how, which collectives go where
    program = tensor_parallel(program, plan=plan)   # then minimize(): the backward follows

* `column` / `row` name Linear layers by module path or pattern, as recompute's checkpoints
  (``*`` is one path component; passes/recompute.py resolves them). Each names the Linear op
  producing that module's output; anything else is refused naming its printed line.
* A column-parallel Linear keeps this rank's rows of its weight [out, in] and bias (a 1/mp slice
  of every block when its output is split into pieces right after, as GPT-2's fused c_attn
  [3H, H] into q, k, v: each rank holds its own heads of each); its input goes through
  ``TPCopy`` (Megatron's f: identity forward, all-reduce sum backward). Several column layers
  reading one value share one TPCopy, so the backward sums their grads before one all-reduce.
* The split then propagates op by op through the rules of metaopt/ops/sharding.py (elementwise
  ops, Split of a fused projection, Reshape to heads and back with the head count rewritten,
  Transpose, attention over split heads). An op with a split input and no rule, or whose rule
  refuses, stops the pass with an error naming the op's printed line and why; dropout with
  p > 0 in the split region raises NotImplementedError (MP-aware RNG is not there yet).
* A row-parallel Linear keeps this rank's columns of its weight (in the layout its split input
  has); it computes a partial product without bias, ``TPReduce`` (Megatron's g: all-reduce sum
  forward, identity backward) sums it over the group, and the full bias is added once after, as
  Megatron's RowParallelLinear does. The Add writes the layer's original output name.
* A split value must end in a row-parallel layer: one that reaches a program output is refused.

The pass is pure and runs on the forward program, before append_backward: the backward comes
from the gradient rules (TPCopy's is a TPReduce, TPReduce's an Identity). Each rank applies it
with its own `mp_rank`; every rank of the group must be fed the same batch. `unshard` puts a
param's per-rank slices back together (in rank order), the inverse of the slicing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from metaopt.ir import Op, Program, Var, did_you_mean, names, roles
from metaopt.ir.printer import fmt_op
from metaopt.ops import sharding
from metaopt.ops.sharding import Shard, ShardArgs
from metaopt.passes.recompute import RecomputeError, resolve_checkpoints


class TensorParallelError(ValueError):
    pass


@dataclass(frozen=True)
class Layer:
    """A column- or row-parallel Linear: op index, vars, and the block layout of its split dim
    (column: of its output features; row: of its input features, as its input is split)."""

    index: int
    kind: str  # "column" | "row"
    x: str
    weight: str
    bias: str  # "" when none
    out: str
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SplitParam:
    name: str
    layer: str  # the Linear's output var (its module path)
    axis: int  # 0: rows (column-parallel weight and bias), 1: columns (row-parallel weight)
    blocks: tuple[int, ...]
    full_shape: tuple
    local_shape: tuple


@dataclass(frozen=True)
class Change:
    """An op in a split region whose constants or attrs change for this rank's slice."""

    index: int
    constants: dict[int, list]
    attrs: dict
    note: str


@dataclass
class TensorParallelPlan:
    mp_degree: int
    mp_rank: int
    group: tuple[int, ...]
    layers: dict[int, Layer] = field(default_factory=dict)
    changes: dict[int, Change] = field(default_factory=dict)
    params: list[SplitParam] = field(default_factory=list)
    sharded: dict[str, Shard] = field(default_factory=dict)  # split activations (full layout)
    events: list[str] = field(default_factory=list)  # what the rewrite does, in program order
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        kinds = [layer.kind for layer in self.layers.values()]
        head = (
            f"tensor_parallel: mp_degree={self.mp_degree} mp_rank={self.mp_rank} group={list(self.group)}: "
            f"{kinds.count('column')} column and {kinds.count('row')} row layers, {len(self.params)} params "
            f"split, {len(self.changes)} ops rewritten"
        )
        return "\n".join([head, *(f"  {e}" for e in self.events), *(f"  skipped  {s}" for s in self.skipped)])

    def param(self, name: str) -> SplitParam:
        for sp in self.params:
            if sp.name == name:
                return sp
        raise KeyError(f"param {name!r} is not split{did_you_mean(name, [sp.name for sp in self.params])}")


# --- slicing ---------------------------------------------------------------------------------


def shard_tensor(t: torch.Tensor, axis: int, blocks: Sequence[int], mp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `t`: its 1/mp of every block along `axis`, concatenated."""
    parts, at = [], 0
    for b in blocks:
        parts.append(t.narrow(axis, at + rank * (b // mp), b // mp))
        at += b
    return torch.cat(parts, axis).contiguous()


def unshard(parts: Sequence[torch.Tensor], axis: int, blocks: Sequence[int]) -> torch.Tensor:
    """The full tensor from every rank's slice (in rank order): the inverse of `shard_tensor`."""
    mp = len(parts)
    pieces, at = [], 0
    for b in blocks:
        pieces += [p.narrow(axis, at, b // mp) for p in parts]
        at += b // mp
    return torch.cat(pieces, axis)


# --- plan ------------------------------------------------------------------------------------


def plan_tensor_parallel(
    p: Program,
    *,
    mp_degree: int,
    mp_rank: int,
    column: Sequence[str],
    row: Sequence[str],
    group: Sequence[int],
) -> TensorParallelPlan:
    """Which params split how, which collectives go where, which ops change (module doc)."""
    _check_args(p, mp_degree, mp_rank, group)
    plan = TensorParallelPlan(mp_degree, mp_rank, tuple(group))
    producers, consumers = p.producers(), p.consumers()
    cols, rows = _resolve(p, column, "column", producers), _resolve(p, row, "row", producers)
    kinds = {**cols, **rows}
    both = set(cols) & set(rows)
    if both:
        i = min(both)
        raise TensorParallelError(f"`{fmt_op(p.ops[i])}` is named both column- and row-parallel")
    copied: set[str] = set()
    for i, op in enumerate(p.ops):
        kind = kinds.get(i)
        if kind == "column":
            _plan_column(p, plan, i, consumers, copied)
        elif kind == "row":
            _plan_row(p, plan, i, consumers)
        elif any(x in plan.sharded for x in op.inputs if x):
            _plan_through(p, plan, i)
        elif sharding.linear_parts(op) is not None:
            plan.skipped.append(f"{op.outputs[0]}: a Linear not named in column or row (replicated)")
    _check_region_ends(p, plan)
    return plan


def _check_args(p: Program, mp: int, rank: int, group: Sequence[int]) -> None:
    if mp < 1 or not 0 <= rank < mp:
        raise TensorParallelError(f"mp_degree must be >= 1 and 0 <= mp_rank < mp_degree, got {mp} and {rank}")
    if len(group) != mp or len(set(group)) != mp:
        raise TensorParallelError(
            f"group must list the {mp} distinct global ranks of the MP group, got {group}"
        )
    late = next((op for op in p.ops if not roles.is_forward(op.role)), None)
    if late is not None:
        raise TensorParallelError(
            f"tensor_parallel rewrites the forward of program {p.name!r}, but it already has a {late.role} "
            f"op (`{fmt_op(late)}`): apply it before append_backward / minimize"
        )


def _resolve(p: Program, patterns: Sequence[str], kind: str, producers: dict[str, int]) -> dict[int, str]:
    """Op index of each Linear the patterns name (module paths or patterns, as recompute's)."""
    out: dict[int, str] = {}
    for pattern in patterns:
        try:
            found = resolve_checkpoints(p, [pattern])
        except RecomputeError:
            raise TensorParallelError(
                f"{kind} layer {pattern!r} is neither a module nor a var of {p.name!r}"
                f"{did_you_mean(pattern, [*p.modules, *p.vars])}"
            ) from None
        for v in found:
            i = producers.get(v)
            if i is None or sharding.linear_parts(p.ops[i]) is None:
                what = f"`{fmt_op(p.ops[i])}`" if i is not None else "no op (an input or param)"
                raise TensorParallelError(f"{kind} layer {pattern!r}: {v!r} is made by {what}, not a Linear")
            out[i] = kind
    return out


def _sole_reader(p: Program, plan_kind: str, op: Op, w: str, consumers: dict[str, list[int]]) -> None:
    # A param read elsewhere too (tied) would be sliced under that other reader's feet.
    if len(consumers.get(w, [])) != 1:
        raise TensorParallelError(
            f"`{fmt_op(op)}`: its weight {w!r} is read by other ops too; a {plan_kind}-"
            "parallel weight must be this layer's own"
        )


def _plan_column(p: Program, plan: TensorParallelPlan, i: int, consumers: dict, copied: set[str]) -> None:
    op = p.ops[i]
    x, w, b = sharding.linear_parts(op)
    out = op.outputs[0]
    if x in plan.sharded:
        raise TensorParallelError(f"`{fmt_op(op)}`: a column-parallel layer's input {x!r} is itself split")
    _sole_reader(p, "column", op, w, consumers)
    blocks = _column_blocks(p, out, consumers)
    mp = plan.mp_degree
    if any(n % mp for n in blocks):
        raise TensorParallelError(
            f"`{fmt_op(op)}`: output features {list(blocks)} not divisible by mp_degree {mp}"
        )
    plan.layers[i] = Layer(i, "column", x, w, b, out, blocks)
    if x not in copied:
        copied.add(x)
        plan.events.append(f"TPCopy   {x} -> {names.tp_copy(x)}  (identity; backward: all-reduce sum)")
    texts = [_split_param(p, plan, w, out, 0, blocks)]
    if b:
        texts.append(_split_param(p, plan, b, out, 0, blocks))
    layout = f"{len(blocks)} blocks {list(blocks)}, 1/{mp} of each" if len(blocks) > 1 else "rows"
    plan.events.append(f"column   {out}: {', '.join(texts)}  ({layout})")
    rank = len(p.vars[out].shape)
    plan.sharded[out] = Shard(rank - 1, blocks)


def _column_blocks(p: Program, out: str, consumers: dict[str, list[int]]) -> tuple[int, ...]:
    """One block, or the pieces a Split right after cuts the features into (a fused q, k, v)."""
    full = p.vars[out].shape
    readers = consumers.get(out, [])
    if len(readers) == 1:
        op = p.ops[readers[0]]
        rule = sharding.rule(op.type)
        if rule is not None and rule.blocks_hint is not None:
            hint = rule.blocks_hint(op, full, lambda name: _constant(p, name))
            if hint is not None:
                return hint
    return (full[-1],)


def _split_param(
    p: Program, plan: TensorParallelPlan, name: str, layer: str, axis: int, blocks: tuple
) -> str:
    full = tuple(p.vars[name].shape)
    local = Shard(axis, blocks).local_shape(full, plan.mp_degree)
    plan.params.append(SplitParam(name, layer, axis, blocks, full, local))
    return f"{name} {list(full)} -> {list(local)}"


def _plan_row(p: Program, plan: TensorParallelPlan, i: int, consumers: dict) -> None:
    op = p.ops[i]
    x, w, b = sharding.linear_parts(op)
    out = op.outputs[0]
    s = plan.sharded.get(x)
    if s is None or s.axis != len(p.vars[x].shape) - 1:
        why = "replicated" if s is None else f"split on axis {s.axis}, not its features"
        raise TensorParallelError(
            f"`{fmt_op(op)}`: a row-parallel layer's input {x!r} is {why}; name a column-parallel layer "
            "before it"
        )
    _sole_reader(p, "row", op, w, consumers)
    plan.layers[i] = Layer(i, "row", x, w, b, out, s.blocks)
    text = _split_param(p, plan, w, out, 1, s.blocks)
    bias = f"; bias {b} added once after the all-reduce" if b else ""
    plan.events.append(f"row      {out}: {text}  (columns){bias}")
    src = names.tp_partial(out)
    dst = names.tp_reduced(out) if b else out
    plan.events.append(f"TPReduce {src} -> {dst}  (all-reduce sum; backward: identity)")


def _plan_through(p: Program, plan: TensorParallelPlan, i: int) -> None:
    op = p.ops[i]
    rule = sharding.rule(op.type)
    if rule is None:
        raise TensorParallelError(
            f"tensor parallel: the split value(s) {[x for x in op.inputs if x in plan.sharded]} cannot pass "
            f"through `{fmt_op(op)}`: no split rule for {op.type} (metaopt/ops/sharding.py); end the split "
            "region before it with a row-parallel layer"
        )
    args = ShardArgs(
        op=op,
        shards=[plan.sharded.get(x) if x else None for x in op.inputs],
        shapes=[_shape(p, x) for x in op.inputs],
        out_shapes=[_shape(p, o) for o in op.outputs],
        mp=plan.mp_degree,
        constant=lambda name: _constant(p, name),
    )
    try:
        res = rule.propagate(args)
    except sharding.ShardNotImplemented as e:
        raise NotImplementedError(f"tensor parallel: `{fmt_op(op)}`: {e}") from None
    except sharding.ShardRefused as e:
        raise TensorParallelError(
            f"tensor parallel: the split cannot pass through `{fmt_op(op)}`: {e}"
        ) from None
    for o, s in zip(op.outputs, res.outputs):
        if o and s is not None:
            if any(n % plan.mp_degree for n in s.blocks):
                raise TensorParallelError(
                    f"tensor parallel: `{fmt_op(op)}`: {o!r} blocks {list(s.blocks)} not divisible by "
                    f"mp_degree {plan.mp_degree}"
                )
            plan.sharded[o] = s
    if res.constants or res.attrs:
        plan.changes[i] = Change(i, res.constants, res.attrs, res.note)
        plan.events.append(f"{op.type:<8} {op.outputs[0]}: {res.note}")


def _shape(p: Program, name: str) -> tuple | None:
    """`name`'s full shape; None for an omitted input or an unknown shape."""
    return tuple(p.vars[name].shape) if name and p.vars[name].shape is not None else None


def _constant(p: Program, name: str) -> list | None:
    v = p.vars.get(name)
    t = p.values.get(name)
    if v is None or v.kind != "constant" or t is None:
        return None
    return t.reshape(-1).tolist()


def _check_region_ends(p: Program, plan: TensorParallelPlan) -> None:
    leaving = [x for x in [*p.outputs, p.loss_name, *p.updates.values()] if x in plan.sharded]
    if leaving:
        raise TensorParallelError(
            f"tensor parallel: the split value {leaving[0]!r} is a program output; end its split region "
            "with a row-parallel layer"
        )


# --- rewrite ---------------------------------------------------------------------------------


def tensor_parallel(p: Program, *, plan: TensorParallelPlan) -> Program:
    """A copy of `p` rewritten for `plan`'s rank: params sliced, TPCopy / TPReduce inserted, shape
    constants rewritten, split activations given their local shapes (module doc)."""
    q = p.clone()
    mp, rank = plan.mp_degree, plan.mp_rank
    for sp in plan.params:  # the rank's slice of each split param, the var's shape to match
        q.values[sp.name] = shard_tensor(q.values[sp.name], sp.axis, sp.blocks, mp, rank)
        q.vars[sp.name].shape = sp.local_shape
    for name, s in plan.sharded.items():
        q.vars[name].shape = s.local_shape(tuple(p.vars[name].shape), mp)
    ops: list[Op] = []
    copies: dict[str, str] = {}
    for i, op in enumerate(q.ops):
        layer = plan.layers.get(i)
        if layer is not None and layer.kind == "column":
            ops += _rewrite_column(q, op, layer, plan, copies)
        elif layer is not None:
            ops += _rewrite_row(q, op, layer, plan)
        else:
            if i in plan.changes:
                _rewrite_change(q, op, plan.changes[i])
            ops.append(op)
    q.ops = ops
    _drop_unread_constants(p, q)
    q.sort_vars()  # the new constants among the constants: the printed program reads top-down
    return q


def _rewrite_column(q: Program, op: Op, layer: Layer, plan: TensorParallelPlan, copies: dict) -> list[Op]:
    new: list[Op] = []
    if layer.x not in copies:
        xv = q.vars[layer.x]
        name = names.fresh(names.tp_copy(layer.x), q.vars)
        q.add_var(Var(name, xv.dtype, xv.shape))
        copies[layer.x] = name
        attrs = {"group": list(plan.group)}
        new.append(Op("TPCopy", [layer.x], [name], attrs, role=op.role, scope=op.scope, origin=layer.x))
    op.inputs[0] = copies[layer.x]
    return [*new, op]


def _rewrite_row(q: Program, op: Op, layer: Layer, plan: TensorParallelPlan) -> list[Op]:
    out = q.vars[layer.out]
    partial = names.fresh(names.tp_partial(layer.out), q.vars)
    q.add_var(Var(partial, out.dtype, out.shape))
    reduced = layer.out
    if layer.bias:
        reduced = names.fresh(names.tp_reduced(layer.out), q.vars)
        q.add_var(Var(reduced, out.dtype, out.shape))
    kw = {"role": op.role, "scope": op.scope, "origin": op.origin}
    ops = [
        Op(op.type, [layer.x, layer.weight, ""], [partial], dict(op.attrs), **kw),
        Op("TPReduce", [partial], [reduced], {"group": list(plan.group)}, **kw),
    ]
    if layer.bias:  # Megatron: the full bias, once, after the sum (not 1/mp of it on each rank)
        ops.append(Op("Add", [reduced, layer.bias], [layer.out], {}, **kw))
    return ops


def _rewrite_change(q: Program, op: Op, change: Change) -> None:
    for k, value in change.constants.items():
        src = op.inputs[k]
        name = names.fresh(names.tp_local(src), q.vars)
        v = q.vars[src]
        t = torch.tensor(value, dtype=q.values[src].dtype).reshape(q.values[src].shape)
        q.add_var(Var(name, v.dtype, v.shape, kind="constant"), t)
        op.inputs[k] = name
    op.attrs.update(change.attrs)


def _drop_unread_constants(p: Program, q: Program) -> None:
    # The replaced shape constants nothing reads any more (each reshape had its own, usually).
    read = {x for op in q.ops for x in op.inputs if x}
    was_read = p.consumers()
    for name in list(q.vars):
        if q.vars[name].kind == "constant" and name not in read and name in was_read:
            del q.vars[name]
            q.values.pop(name, None)

"""Sequence parallel beside tensor parallel (Megatron's; Korthikanti et al. 2022), as a rewrite of
a tensor-parallel forward program by var name.

    tp = tensor_parallel(program, plan=plan_tensor_parallel(program, ...))
    plan = plan_sequence_parallel(tp, group=[0, 1])
    print(plan)                     # what is split along the sequence, where it is gathered
    program = sequence_parallel(tp, plan=plan)   # then minimize(): the backward follows

Requires: the forward of a tensor-parallel program (its TPReduce / TPCopy ops), before
append_backward. Ensures: the values between a row-parallel layer and the next column-parallel
one (norms, dropout, bias and residual adds) hold this rank's 1/mp of the sequence (`axis`, 1
for Hugging Face's [batch, seq, hidden]); the rest of the program is as tensor parallel made it.

* **Reduce-scatter.** A row-parallel layer's TPReduce (all-reduce of its partial product) moves
  past the reshapes that put a 2-D Gemm's rows back into [batch, seq, hidden] and becomes
  ``SPReduceScatter`` there: the same sum, this rank's chunk kept. Its bias is added after, on the
  chunk.
* **The regions.** From there the split propagates op by op through the rules of
  metaopt/ops/sharding.py (elementwise ops, dropout, the norms over the hidden dim, reshapes that
  keep the sequence): the same table tensor parallel uses, asked about the sequence axis.
* **Scatter.** A region op reading a replicated value that spans the sequence (the residual
  stream coming from the embeddings) reads this rank's chunk of it, ``SPScatter``. The scatter is
  hoisted up through the ops the split can pass (the embedding dropout and sum), so the region
  starts where that value's replicated computation has to stop (the lookups), as Megatron
  scatters the embeddings' output.
* **Gather.** An op that cannot take the split (a column-parallel layer, the LM head, the
  loss) reads it all-gathered, ``SPGather``. When only column-parallel layers read the gathered
  value (through reshapes), each rank's grad of it is a partial sum: the gather's backward is a
  reduce-scatter and the layers' TPCopy (whose backward all-reduced those partial sums) is
  dropped. Otherwise the backward keeps this rank's chunk of a grad every rank holds alike.
* **Replicated inputs** of region ops that do not span the sequence (norm weights and biases,
  a row-parallel layer's bias) are read through ``TPCopy``: their grads, each rank's partial sum
  over its tokens, are summed over the group (Megatron all-reduces the grads of these
  ``sequence_parallel`` params).
* **Dropout** in the regions draws one process's mask: the whole value's mask from the stream
  every rank shares, each rank keeping its chunk (Dropout's ``slice_axis`` / ``slice_group``),
  so the split run drops exactly what one process drops.

What the plan refuses, naming the op's printed line: a row-parallel product that reaches no
[batch, seq, hidden] value, a sequence length not divisible by the degree, a sequence-split value
leaving the program (an output), a random op other than Dropout in a region.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Var, names, roles, torch_dtype
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry, sharding
from metaopt.ops.sharding import Shard, ShardResult
from metaopt.passes.tensor_parallel import drop_unread_constants, rewrite_constants, shard_args

GATHER_BACKWARDS = ("scatter", "reduce_scatter")


class SequenceParallelError(ValueError):
    pass


@dataclass(frozen=True)
class ReducePoint:
    """A row-parallel layer's TPReduce and what it becomes: the reshapes between it and the
    [batch, seq, hidden] value `out` run on the partial product, then SPReduceScatter, then the
    bias (if any) is added to the chunk."""

    reduce: int  # the TPReduce's op index
    partial: str  # its input: the layer's partial product
    bias_add: int | None  # the Add of the row bias right after it (None: no bias)
    bias: str
    chain: tuple[int, ...]  # the reshapes after it, in order
    out: str


@dataclass
class GroupSplitPlan:
    """What the plans of sequence and segment parallel share: the degree, the group (its global
    ranks, ascending, or its name), the split axis, and how they print the group and the op types
    of the ops on the local sequence."""

    degree: int
    group: tuple[int, ...] | str
    axis: int

    def _group_text(self) -> str:
        return self.group if isinstance(self.group, str) else str(list(self.group))

    def _kinds_text(self, region: dict[int, ShardResult], types: dict[int, str]) -> str:
        kinds = Counter(types.get(i, "?") for i in region)
        return ", ".join(f"{t} x{n}" for t, n in sorted(kinds.items()))


@dataclass
class SequencePlan(GroupSplitPlan):
    length: int = 0  # the sequence length (whole)
    reduces: list[ReducePoint] = field(default_factory=list)
    split: dict[str, Shard] = field(default_factory=dict)  # sequence-split values (whole layout)
    region: dict[int, ShardResult] = field(default_factory=dict)  # region op -> its rule's result
    scatters: list[str] = field(default_factory=list)  # replicated values whose chunk regions read
    gathers: dict[str, str] = field(default_factory=dict)  # split value -> its gather's backward
    gather_at: dict[str, int] = field(default_factory=dict)  # split value -> its first whole reader
    copies: dict[str, int] = field(default_factory=dict)  # replicated region input -> first reader
    dropped_copies: list[int] = field(default_factory=list)  # TPCopy ops a reduce-scatter replaces
    draws: list[int] = field(default_factory=list)  # region Dropouts: one process's mask, sliced
    events: list[str] = field(default_factory=list)
    _types: dict[int, str] = field(default_factory=dict, repr=False)  # op index -> type, for printing

    def __str__(self) -> str:
        ops = self._kinds_text(self.region, self._types)
        head = (
            f"sequence_parallel: degree={self.degree} group={self._group_text()} axis={self.axis} "
            f"seq={self.length} (local {self.length // self.degree}): {len(self.reduces)} reduce-scatters, "
            f"{len(self.scatters)} scatters, {len(self.gathers)} gathers, {len(self.region)} ops on the "
            f"local sequence ({ops})"
        )
        return "\n".join([head, *(f"  {e}" for e in self.events)])

    def whole(self) -> Shard:
        """How a value spanning the sequence is split (values of the regions' rank and up:
        `_spans_sequence` takes no lower one)."""
        return Shard(self.axis, (self.length,))

    def attrs(self) -> dict:
        return {"axis": self.axis, "group": self.group if isinstance(self.group, str) else list(self.group)}


# --- plan ------------------------------------------------------------------------------------


def plan_sequence_parallel(
    p: Program, *, degree: int, group: Sequence[int] | str, axis: int = 1
) -> SequencePlan:
    """Where the sequence is split, scattered and gathered in tensor-parallel forward `p`
    (module doc). `degree`: the model-parallel degree; `group`: the model-parallel group as
    its TPReduce ops name it."""
    group = checked_group(p, "sequence_parallel", "model-parallel", degree, group, SequenceParallelError)
    plan = SequencePlan(degree, group, axis, _types={i: op.type for i, op in enumerate(p.ops)})
    producers, consumers = p.producers(), p.consumers()
    plan.reduces = _reduce_points(p, plan, consumers)
    if not plan.reduces:
        others = sorted({str(_group_of(op)) for op in p.ops if sharding.sequence_kind(op) == "reduce"})
        why = (
            f"its TPReduce ops are over {others}: give that group"
            if others
            else "apply tensor_parallel first (sequence parallel splits the regions between its layers)"
        )
        raise SequenceParallelError(
            f"sequence_parallel: program {p.name!r} has no TPReduce over group {plan._group_text()}: {why}"
        )
    plan.length = _length(p, plan)
    sources: set[str] = set()
    while True:  # hoist the scatters as far up as the split passes (module doc)
        state = _propagate(p, plan, sources)
        hoisted: set[str] = set()
        for x in sources | state.requests:
            hoisted |= _hoist(p, plan, x, producers)
        if hoisted == sources:
            break
        sources = hoisted
    plan.split, plan.region = state.split, state.region
    plan.scatters = sorted(sources, key=lambda v: producers.get(v, -1))
    _plan_gathers(p, plan, state.readers, consumers)
    _plan_copies(p, plan)
    _plan_draws(p, plan)
    _check_outputs(p, plan)
    _describe(p, plan)
    return plan


def checked_group(
    p: Program, who: str, axis: str, degree: int, group: Sequence[int] | str, error: type[Exception]
) -> tuple[int, ...] | str:
    """`group` as a plan holds it, once `p` is found a forward program (the split passes run before
    the backward) and `group` the `degree` ranks of its `axis` group, ascending; else `error`."""
    late = next((op for op in p.ops if not roles.is_forward(op.role)), None)
    if late is not None:
        raise error(
            f"{who} rewrites the forward of program {p.name!r}, but it already has a {late.role} op "
            f"(`{fmt_op(late)}`): apply it before append_backward / minimize"
        )
    group = group if isinstance(group, str) else tuple(group)
    if not isinstance(group, str) and (len(group) != degree or list(group) != sorted(set(group))):
        raise error(
            f"{who}: group {list(group)} must list the {degree} global ranks of the {axis} group, "
            f"ascending (degree={degree})"
        )
    return group


def _reduce_points(p: Program, plan: SequencePlan, consumers: dict) -> list[ReducePoint]:
    out = []
    for i, op in enumerate(p.ops):
        if sharding.sequence_kind(op) != "reduce" or _group_of(op) != plan.group:
            continue
        at, bias_add, bias, chain = op.outputs[0], None, "", []
        readers = consumers.get(at, [])
        if len(readers) == 1 and _is_bias_add(p, p.ops[readers[0]], at):
            bias_add = readers[0]
            bias = p.ops[bias_add].inputs[1]
            at = p.ops[bias_add].outputs[0]
            readers = consumers.get(at, [])
        while not _spans_sequence(p, at, plan) and len(readers) == 1:
            nxt = p.ops[readers[0]]
            if not sharding.keeps_features(nxt, _shape(p, at), _shape(p, nxt.outputs[0])):
                break
            chain.append(readers[0])
            at = nxt.outputs[0]
            readers = consumers.get(at, [])
        if not _spans_sequence(p, at, plan):
            raise SequenceParallelError(
                f"sequence_parallel: the row-parallel sum `{fmt_op(op)}` reaches no [batch, seq, hidden] "
                f"value through reshapes (it reaches {at!r}, shape {_shape(p, at)}): sequence parallel needs "
                "a row-parallel layer's output along the sequence"
            )
        out.append(ReducePoint(i, op.inputs[0], bias_add, bias, tuple(chain), at))
    return out


def _is_bias_add(p: Program, op: Op, x: str) -> bool:
    if sharding.sequence_kind(op) != "bias" or op.inputs[0] != x or len(op.inputs) != 2:
        return False
    b = p.vars.get(op.inputs[1])
    return b is not None and b.kind == "param" and len(b.shape or ()) == 1


def _group_of(op: Op) -> tuple[int, ...] | str:
    g = op.attrs.get("group")
    return g if isinstance(g, str) else tuple(g or ())


def _shape(p: Program, name: str) -> tuple | None:
    return tuple(p.vars[name].shape) if name and p.vars[name].shape is not None else None


def _spans_sequence(p: Program, name: str, plan: SequencePlan) -> bool:
    """Whether `name` has the sequence at `plan.axis` (the whole length, once it is known)."""
    shape = _shape(p, name)
    # [batch, seq, hidden] and up: in a 2-D [tokens, hidden] value axis 1 is the hidden size,
    # which may happen to equal the sequence length
    if shape is None or len(shape) <= plan.axis + 1:
        return False
    d = shape[plan.axis]
    return isinstance(d, int) and d > 1 and (not plan.length or d == plan.length)


def _length(p: Program, plan: SequencePlan) -> int:
    lengths = {p.vars[r.out].shape[plan.axis] for r in plan.reduces}
    if len(lengths) != 1:
        raise SequenceParallelError(
            f"sequence_parallel: the row-parallel layers' outputs have sequence lengths {sorted(lengths)} "
            f"along axis {plan.axis}; one length is split"
        )
    (n,) = lengths
    if n % plan.degree:
        raise SequenceParallelError(
            f"sequence_parallel: sequence length {n} (axis {plan.axis} of {plan.reduces[0].out!r}) is not "
            f"divisible by the model-parallel degree {plan.degree}; pad the sequence to a multiple of it"
        )
    return n


@dataclass
class _State:
    split: dict[str, Shard]
    region: dict[int, ShardResult]
    requests: set[str]  # replicated values spanning the sequence that region ops read
    readers: dict[str, list[int]]  # split value -> the ops reading it that cannot take the split


def _owned(plan: SequencePlan) -> set[int]:
    """The ops of the reduce points (TPReduce, bias Add, reshapes): rewritten as one."""
    return {i for r in plan.reduces for i in _indices(r)}


def _propagate(p: Program, plan: SequencePlan, sources: set[str]) -> _State:
    state = _State({x: plan.whole() for x in [*(r.out for r in plan.reduces), *sources]}, {}, set(), {})
    owned = _owned(plan)
    for i, op in enumerate(p.ops):
        if i in owned or not any(x in state.split for x in op.inputs if x):
            continue
        want = [x for x in op.inputs if x and x not in state.split and _spans_sequence(p, x, plan)]
        res = _try_rule(p, plan, op, {**state.split, **dict.fromkeys(want, plan.whole())})
        if res is None:
            for x in op.inputs:
                if x in state.split and x not in sources:  # a source is whole under its own name
                    state.readers.setdefault(x, []).append(i)
            continue
        state.region[i] = res
        state.requests |= set(want)
        for o, s in zip(op.outputs, res.outputs):
            if o and s is not None:
                state.split[o] = s
    return state


def _try_rule(p: Program, plan: SequencePlan, op: Op, split: dict[str, Shard]) -> ShardResult | None:
    """The op's rule asked about the sequence split (None: it cannot take it, or it is a
    tensor-parallel collective, whose inputs are gathered)."""
    rule = sharding.rule(op.type)
    if rule is None or sharding.sequence_kind(op) in ("copy", "reduce") or registry.get(op.type).collective:
        return None
    try:
        res = rule.propagate(shard_args(p, op, split, plan.degree))
    except (sharding.ShardRefused, sharding.ShardNotImplemented):
        return None
    if any(s is not None and any(b % plan.degree for b in s.blocks) for s in res.outputs):
        return None
    return res


def _hoist(p: Program, plan: SequencePlan, x: str, producers: dict) -> set[str]:
    """What to scatter so that `x` is made on the local sequence: the inputs of its producer
    that span the sequence, when that op can take the split; else `x` itself."""
    i = producers.get(x)
    if i is None or i in _owned(plan):
        return {x}
    op = p.ops[i]
    ins = [v for v in op.inputs if v and _spans_sequence(p, v, plan)]
    if not ins or p.vars[x].kind != "activation":
        return {x}
    res = _try_rule(p, plan, op, dict.fromkeys(ins, plan.whole()))
    if res is None or any(o == x and s is None for o, s in zip(op.outputs, res.outputs)):
        return {x}
    return set(ins)


def _plan_gathers(p: Program, plan: SequencePlan, readers: dict[str, list[int]], consumers: dict) -> None:
    dropped: list[int] = []
    for x in sorted(readers, key=lambda v: min(readers[v])):
        plan.gather_at[x] = min(readers[x])
        copies = _copies_behind(p, readers[x], consumers)
        if copies is None:
            plan.gathers[x] = "scatter"
        else:
            plan.gathers[x] = "reduce_scatter"
            dropped += copies
    plan.dropped_copies = sorted(set(dropped))


def _copies_behind(p: Program, readers: list[int], consumers: dict) -> list[int] | None:
    """The TPCopy ops every one of `readers` leads to through reshapes (only column-parallel
    layers read the value: its grads are partial sums); None when any reader is something else."""
    found: list[int] = []
    todo = list(readers)
    while todo:
        i = todo.pop()
        op = p.ops[i]
        if sharding.sequence_kind(op) == "copy":
            found.append(i)
        elif sharding.is_view(op) and len(op.outputs) == 1 and consumers.get(op.outputs[0]):
            todo += consumers[op.outputs[0]]
        else:
            return None
    return found


def _plan_copies(p: Program, plan: SequencePlan) -> None:
    """Replicated inputs of region ops that do not span the sequence and carry grads (and the
    row-parallel biases, added to the chunk), each with the first op reading it there."""
    for r in plan.reduces:
        if r.bias:
            plan.copies.setdefault(r.bias, r.chain[-1] if r.chain else r.bias_add)
    for i, op in enumerate(p.ops):
        if i not in plan.region:
            continue
        hosts = set(registry.host_inputs(op, p))
        for k, x in enumerate(op.inputs):
            if not x or x in plan.split or x in plan.copies or k in hosts:
                continue
            v = p.vars[x]
            if v.kind != "constant" and torch_dtype(v.dtype).is_floating_point:
                plan.copies[x] = i


def _plan_draws(p: Program, plan: SequencePlan) -> None:
    for i, res in plan.region.items():
        if not res.draws:
            continue
        op = p.ops[i]
        if sharding.sequence_kind(op) != "sliced_draw":
            raise NotImplementedError(
                f"sequence_parallel: `{fmt_op(op)}` draws random numbers on the local sequence; only "
                "Dropout draws one process's mask there so far"
            )
        plan.draws.append(i)


def _check_outputs(p: Program, plan: SequencePlan) -> None:
    leaving = [x for x in [*p.outputs, p.loss_name, *p.updates.values()] if x in plan.split]
    if leaving:
        raise NotImplementedError(
            f"sequence_parallel: the sequence-split value {leaving[0]!r} is a program output; gathering "
            "an output back whole is not built (fetch a value after the last column-parallel layer)"
        )


def _describe(p: Program, plan: SequencePlan) -> None:
    ev = plan.events
    local = plan.length // plan.degree
    for r in plan.reduces:
        bias = f"; bias {r.bias} added to the chunk" if r.bias else ""
        ev.append(f"reduce   {r.out}: the row-parallel sum of {r.partial} (TPReduce) -> SPReduceScatter "
                  f"(seq {plan.length} -> {local}){bias}")  # fmt: skip
    for x in plan.scatters:
        ev.append(f"scatter  {x} -> {names.sp_scattered(x)}  (this rank's chunk; backward: all-gather)")
    for x, kind in plan.gathers.items():
        why = (
            "backward: reduce-scatter, the column layers' TPCopy dropped"
            if kind == "reduce_scatter"
            else "backward: this rank's chunk"
        )
        ev.append(f"gather   {x} -> {names.sp_gathered(x)}  ({why})")
    for x in plan.copies:
        ev.append(f"TPCopy   {x}  (read on the local sequence: its grad summed over the group)")
    for i in plan.draws:
        ev.append(
            f"dropout  {p.ops[i].outputs[0]}: one process's mask (drawn whole from the shared stream, "
            "this rank's chunk kept)"
        )


# --- rewrite ---------------------------------------------------------------------------------


def sequence_parallel(p: Program, *, plan: SequencePlan) -> Program:
    """A copy of `p` rewritten for `plan` (module doc): one sweep, the new ops placed by the
    plan's indices (a scatter right after its value's producer, a gather right before its value's
    first whole reader, a TPCopy right before its value's first region reader)."""
    q = p.clone()
    for name, s in plan.split.items():
        if name not in plan.scatters:  # a source keeps its whole value; its chunk is a new var
            q.vars[name].shape = s.local_shape(tuple(p.vars[name].shape), plan.degree)
    new = _new_vars(p, q, plan)
    before, after, start = _placed_ops(p, plan, new)
    owned = {i: r for r in plan.reduces for i in _indices(r)}
    dropped = set(plan.dropped_copies)
    group = plan.attrs()["group"]
    ops: list[Op] = list(start)
    for i, op in enumerate(q.ops):
        ops += before.get(i, [])
        if i in dropped:  # its readers read the gathered value: the gather's backward sums
            continue
        if i in owned:
            ops += _rewrite_reduce(q, op, i, owned[i], new, plan)
        else:
            _rename_inputs(p, op, i, plan, new)
            if i in plan.region:
                rewrite_constants(q, op, plan.region[i].constants, plan.region[i].attrs)
            if i in plan.draws:
                op.attrs.update({"rng": "shared", "slice_axis": plan.axis, "slice_group": group})
            ops.append(op)
        ops += after.get(i, [])
    q.ops = ops
    drop_unread_constants(p, q)
    q.sort_vars()
    return q


def _indices(r: ReducePoint) -> list[int]:
    return [r.reduce, *([r.bias_add] if r.bias_add is not None else []), *r.chain]


def _new_vars(p: Program, q: Program, plan: SequencePlan) -> dict[str, dict[str, str]]:
    """The names (and vars) of every value the rewrite adds, by kind and the value they stem from."""
    new: dict[str, dict[str, str]] = {"scatter": {}, "gather": {}, "copy": {}, "partial": {}, "reduced": {}}

    def add(kind: str, x: str, name: str, shape) -> None:  # noqa: ANN001
        new[kind][x] = names.fresh(name, q.vars)
        q.add_var(Var(new[kind][x], p.vars[x].dtype, shape))

    for x in plan.scatters:
        add("scatter", x, names.sp_scattered(x), _local(p, x, plan))
    for x in plan.gathers:
        add("gather", x, names.sp_gathered(x), p.vars[x].shape)
    for x in plan.copies:
        add("copy", x, names.tp_copy(x), p.vars[x].shape)
    for r in plan.reduces:
        for i in r.chain:  # the reshapes run on the partial product, under new names
            o = p.ops[i].outputs[0]
            add("partial", o, names.tp_partial(o), p.vars[o].shape)
        if r.bias:
            add("reduced", r.out, names.tp_reduced(r.out), _local(p, r.out, plan))
    return new


def _local(p: Program, x: str, plan: SequencePlan) -> tuple:
    return plan.whole().local_shape(tuple(p.vars[x].shape), plan.degree)


def _placed_ops(p: Program, plan: SequencePlan, new: dict) -> tuple[dict, dict, list]:
    """(ops before op i, ops after op i, ops at the program's start) for the scatters, gathers
    and TPCopys the plan adds."""
    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    start: list[Op] = []
    producers = p.producers()
    attrs = plan.attrs()
    for x in plan.scatters:
        i = producers.get(x)
        kw = _kw(p, i, x)
        op = Op("SPScatter", [x], [new["scatter"][x]], dict(attrs), **kw)
        (after.setdefault(i, []) if i is not None else start).append(op)
    for x, i in plan.copies.items():
        op = Op("TPCopy", [x], [new["copy"][x]], {"group": attrs["group"]}, **_kw(p, i, x))
        before.setdefault(i, []).append(op)
    for x, kind in plan.gathers.items():
        i = plan.gather_at[x]
        op = Op("SPGather", [x], [new["gather"][x]], {**attrs, "backward": kind}, **_kw(p, i, x))
        before.setdefault(i, []).append(op)
    return before, after, start


def _kw(p: Program, i: int | None, origin: str) -> dict:
    if i is None:
        return {"role": roles.FORWARD, "origin": origin}
    op = p.ops[i]
    return {"role": op.role, "scope": op.scope, "origin": origin}


def _rewrite_reduce(q: Program, op: Op, i: int, r: ReducePoint, new: dict, plan: SequencePlan) -> list[Op]:
    """The TPReduce, bias Add and reshapes of reduce point `r`: the reshapes on the partial
    product, then SPReduceScatter and the bias on the chunk, at the last of them."""
    out: list[Op] = []
    kw = {"role": op.role, "scope": op.scope, "origin": op.origin}
    if i in r.chain:
        k = r.chain.index(i)
        src = r.partial if k == 0 else new["partial"][q.ops[r.chain[k - 1]].outputs[0]]
        dst = new["partial"][op.outputs[0]]
        out.append(Op("Reshape", [src, *op.inputs[1:]], [dst], dict(op.attrs), **kw))
    last = r.chain[-1] if r.chain else (r.bias_add if r.bias_add is not None else r.reduce)
    if i != last:
        return out
    partial = new["partial"][q.ops[r.chain[-1]].outputs[0]] if r.chain else r.partial
    dst = new["reduced"][r.out] if r.bias else r.out
    out.append(Op("SPReduceScatter", [partial], [dst], plan.attrs(), **kw))
    if r.bias:
        out.append(Op("Add", [dst, new["copy"][r.bias]], [r.out], {}, **kw))
    return out


def _rename_inputs(p: Program, op: Op, i: int, plan: SequencePlan, new: dict) -> None:
    if i in plan.region:  # the local sequence: chunks of sources, TPCopys of replicated inputs
        op.inputs = [new["scatter"].get(x, new["copy"].get(x, x)) if x else x for x in op.inputs]
        return
    dropped = {p.ops[k].outputs[0]: p.ops[k].inputs[0] for k in plan.dropped_copies}
    renamed = []
    for x in op.inputs:
        x = dropped.get(x, x)  # a dropped TPCopy's reader reads what it copied (gathered, below)
        renamed.append(new["gather"].get(x, x) if x else x)
    op.inputs = renamed

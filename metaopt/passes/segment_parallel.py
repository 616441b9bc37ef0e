"""Segment parallel (Paddle's ``hybrid_configs["sep_degree"]``; DeepSpeed-Ulysses, Jacobs et al.
2023) as a rewrite of a forward program by var name.

    plan = plan_segment_parallel(program, degree=2, group=[0, 1])
    print(plan)                     # what runs on the local sequence, what is exchanged, gathered
    program = segment_parallel(program, plan=plan)   # then minimize(): the backward follows

Each of the `degree` ranks of a sep group is fed the same whole batch and holds 1/degree of every
sequence (its contiguous chunk along `axis`, the feeds' token axis) from the embeddings to the
loss; the params are whole on every rank. Requires: a forward program (before append_backward)
with a static sequence length divisible by the degree. Ensures: one process's loss on every rank,
and every param's grad summed over the group, so the ranks update alike.

* **Token-wise ops** take the split: every op tensor parallel's table lets a split pass on that
  axis (norms, elementwise ops, dropout, reshapes keeping the sequence, the rotation) and the
  token-wise rows (``sharding.token_rule``: Linear / Gemm / MatMul with a replicated weight, the
  embedding lookup, reshapes merging [batch, seq] into rows, whose local rows are the chunk of
  every sequence).
* **Scatter.** A split op reading a replicated value that spans the sequence (the feeds, the
  position table, rotary's cos and sin, the shifted labels) reads this rank's chunk of it
  (``SPScatter``), hoisted up as far as the split passes (input_ids rather than the embeddings).
* **Attention** (Ulysses): q, k and v on the local sequence are exchanged (``SepAllToAll``: an
  all-to-all after which a rank holds whole sequences of 1/degree of the heads), attention runs on
  whole sequences over those heads, and its output is exchanged back. Attention dropout draws one
  process's mask, this rank's heads kept (``slice_axis``).
* **The loss**: the mean cross-entropy over the local tokens becomes their sum divided by the
  count of the whole batch's counted tokens (from the whole labels, which every rank holds),
  summed over the group (``TPReduce``, whose backward passes the grad on): every rank's loss is
  one process's, and its backward gives this rank's tokens' part of every grad.
* **Params** read on the local sequence are read through ``TPCopy`` over the group: their grads,
  each rank's partial sum over its tokens, are summed over it.
* **Dropout** on the local sequence draws one process's mask from the stream every rank shares,
  this rank's chunk kept (``slice_axis``), as sequence parallel's.
* **Gather.** An op that cannot take the split reads the value all-gathered (``SPGather``; its
  backward keeps this rank's chunk).
* **Feeds.** The first op (``FeedsAgree``) checks on the first run that every rank of the group
  was fed the same batch, naming the feed that differs.

What the plan refuses, naming the op's printed line or the value: a sequence length not divisible
by the degree (or none found), attention whose heads do not divide by it or whose mask differs per
head, a loss other than a cross-entropy on the local tokens, a random op other than Dropout and
attention there, a split value leaving the program.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from metaopt.ir import TORCH_TO_ONNX, Op, Program, Var, names, roles, torch_dtype
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry, sharding
from metaopt.ops.sharding import Shard, ShardResult
from metaopt.passes.sequence_parallel import GroupSplitPlan, checked_group
from metaopt.passes.tensor_parallel import drop_unread_constants, rewrite_constants, shard_args

GROUP = "sep_parallel"  # how a rewritten program names its sep group (every rank's reads the same)


class SegmentParallelError(ValueError):
    pass


@dataclass(frozen=True)
class Exchange:
    """An attention op on the local sequence: q, k and v exchanged to whole sequences over
    1/degree of the heads before it, its output exchanged back after it."""

    op: int
    heads_axis: int
    seq_axis: int


@dataclass(frozen=True)
class LossPoint:
    """The mean cross-entropy over the local tokens: its sum, divided by the whole batch's count
    of counted labels (`labels`: a whole value every rank holds), summed over the group."""

    op: int
    labels: str
    ignore_index: int | None


@dataclass
class SegmentPlan(GroupSplitPlan):
    length: int = 0
    # context parallel (passes/context_parallel.py): attention as a ring over the local queries
    # instead of the exchange, and the positions each rank holds (sequence_parallel.LAYOUTS)
    ring: bool = False
    layout: str = "contiguous"
    split: dict[str, Shard] = field(default_factory=dict)  # values on the local sequence (whole layout)
    region: dict[int, ShardResult] = field(default_factory=dict)  # op -> its rule's result
    scatters: dict[str, Shard] = field(default_factory=dict)  # replicated value -> where its sequence is
    gathers: dict[str, int] = field(default_factory=dict)  # split value -> its first whole reader
    copies: dict[str, int] = field(default_factory=dict)  # replicated input of split ops -> first reader
    draws: list[int] = field(default_factory=list)  # random ops drawing one process's mask, sliced
    exchanges: list[Exchange] = field(default_factory=list)
    losses: list[LossPoint] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    _types: dict[int, str] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        ops = self._kinds_text(self.region, self._types)
        name = "context_parallel" if self.ring else "segment_parallel"
        attention = "ring attentions" if self.ring else "attention exchanges"
        layout = f" layout={self.layout}" if self.layout != "contiguous" else ""
        head = (
            f"{name}: degree={self.degree} group={self._group_text()} axis={self.axis}{layout} "
            f"seq={self.length} (local {self.length // self.degree}): {len(self.scatters)} scatters, "
            f"{len(self.exchanges)} {attention}, {len(self.gathers)} gathers, "
            f"{len(self.copies)} params summed over the group, {len(self.region)} ops on the local "
            f"sequence ({ops})"
        )
        return "\n".join([head, *(f"  {e}" for e in self.events)])

    def attrs(self) -> dict:
        return {"group": self.group if isinstance(self.group, str) else list(self.group)}

    def layout_attrs(self) -> dict:
        """The `layout` attr of the ops placing positions (omitted when contiguous)."""
        return {} if self.layout == "contiguous" else {"layout": self.layout}


# --- plan ------------------------------------------------------------------------------------


def plan_segment_parallel(
    p: Program,
    *,
    degree: int,
    group: Sequence[int] | str,
    axis: int = 1,
    ring: bool = False,
    layout: str = "contiguous",
) -> SegmentPlan:
    """Where forward `p` runs on the local sequence, and what is scattered, exchanged, gathered
    and summed (module doc). `group`: the sep group's global ranks, ascending, or ``"sep_parallel"``
    (fleet.init's layout). `ring` and `layout`: context parallel's (passes/context_parallel.py)."""
    what = "context_parallel" if ring else "segment_parallel"
    group = checked_group(p, what, "cp" if ring else "sep", degree, group, SegmentParallelError)
    plan = SegmentPlan(
        degree, group, axis, ring=ring, layout=layout, _types={i: op.type for i, op in enumerate(p.ops)}
    )
    plan.length = _length(p, plan)
    producers = p.producers()
    sources = {x: Shard(axis, (plan.length,)) for x in p.inputs if _spans(p, x, plan, axis)}
    while True:  # hoist the scatters as far up as the split passes
        state = _propagate(p, plan, sources)
        hoisted: dict[str, Shard] = {}
        for x, s in {**sources, **state.requests}.items():
            hoisted.update(_hoist(p, plan, x, s, producers))
        if hoisted == sources:
            break
        sources = hoisted
    _check_exchanges(p, state)
    plan.split, plan.region = state.split, state.region
    read = {x for i in state.region for x in p.ops[i].inputs if x}
    plan.scatters = {
        x: s for x, s in sorted(sources.items(), key=lambda kv: producers.get(kv[0], -1)) if x in read
    }
    for x in set(sources) - set(plan.scatters):  # a feed no op reads as chunks stays whole
        del plan.split[x]
    for x, s in plan.scatters.items():
        if not _plain(p, x, s):
            raise NotImplementedError(
                f"segment_parallel: {x!r} (shape {list(p.vars[x].shape)}) would be scattered as the "
                "rows of merged [batch, seq] dims; scattering those is not built"
            )
    plan.gathers = {x: min(rs) for x, rs in sorted(state.readers.items(), key=lambda kv: min(kv[1]))}
    _plan_exchanges(p, plan)
    _plan_losses(p, plan)
    _plan_copies(p, plan)
    _plan_draws(p, plan)
    _check_outputs(p, plan)
    _check_local_shapes(p, plan)
    _describe(p, plan)
    return plan


def _length(p: Program, plan: SegmentPlan) -> int:
    """The sequence length: the feeds' dim `axis` (every feed of rank > axis that has one)."""
    found = {}
    for x in p.inputs:
        shape = p.vars[x].shape
        if shape is not None and len(shape) > plan.axis:
            found[x] = shape[plan.axis]
    lengths = {d for d in found.values() if isinstance(d, int) and d > 1}
    who, key = _who(plan)
    if not found or not lengths:
        raise SegmentParallelError(
            f"{who}: no feed of {p.name!r} has a static sequence length on axis {plan.axis} "
            f"(feeds: { ({x: list(p.vars[x].shape or ()) for x in p.inputs}) }); export with a fixed "
            "sequence length"
        )
    if len(lengths) != 1:
        raise SegmentParallelError(
            f"{who}: the feeds have sequence lengths {found} on axis {plan.axis}; one length is split"
        )
    (n,) = lengths
    runs = plan.degree * (2 if plan.layout == "zigzag" else 1)
    if n % runs:
        what = f"2 x {key} = {runs} (the zigzag layout's runs)" if runs != plan.degree else f"{key} {runs}"
        raise SegmentParallelError(
            f"{who}: sequence length {n} is not divisible by {what}; pad the sequence to a multiple of it"
        )
    return n


def _who(plan: SegmentPlan) -> tuple[str, str]:
    """The pass's name and its degree's config key, for messages."""
    return ("context_parallel", "cp_degree") if plan.ring else ("segment_parallel", "sep_degree")


def _shape(p: Program, name: str) -> tuple | None:
    return tuple(p.vars[name].shape) if name and p.vars[name].shape is not None else None


def _spans(p: Program, x: str, plan: SegmentPlan, axis: int) -> bool:
    shape = _shape(p, x)
    return shape is not None and len(shape) > axis and shape[axis] == plan.length


def _plain(p: Program, x: str, s: Shard) -> bool:
    """Whether `x`'s split axis is the sequence itself (not rows merging [batch, seq])."""
    shape = _shape(p, x)
    return shape is not None and shape[s.axis] == sum(s.blocks)


@dataclass
class _State:
    split: dict[str, Shard]
    region: dict[int, ShardResult]
    requests: dict[str, Shard]  # replicated values spanning the sequence that split ops read
    readers: dict[str, list[int]]  # split value -> the ops reading it that cannot take the split
    refused: dict[int, str] = field(default_factory=dict)  # op reading split values -> why its rule refused


def _propagate(p: Program, plan: SegmentPlan, sources: dict[str, Shard]) -> _State:
    state = _State(dict(sources), {}, {}, {})
    for i, op in enumerate(p.ops):
        if not any(x in state.split for x in op.inputs if x):
            continue
        res, want = _try(p, plan, op, state.split, state.refused, i)
        if res is None:
            for x in op.inputs:
                if x in state.split and x not in sources:  # a source is whole under its own name
                    state.readers.setdefault(x, []).append(i)
            continue
        state.region[i] = res
        state.requests.update(want)
        for o, s in zip(op.outputs, res.outputs):
            if o and s is not None:
                state.split[o] = s
    return state


def _try(
    p: Program, plan: SegmentPlan, op: Op, split: dict[str, Shard], refused: dict[int, str], i: int
) -> tuple[ShardResult | None, dict]:
    """The op's token rule on its split inputs; if it refuses, again with the replicated inputs
    that span the sequence where the split inputs have it read as chunks (scatters requested).
    Why it refuses goes into `refused`."""
    why: list[str] = []
    res = _rule(p, plan, op, split, why)
    if res is not None:
        return res, {}
    want = _aligned(p, plan, op, split)
    if want:
        res = _rule(p, plan, op, {**split, **want}, why)
        if res is not None:
            return res, want
    refused[i] = why[0] if why else "it has no token rule"
    return None, {}


def _aligned(p: Program, plan: SegmentPlan, op: Op, split: dict[str, Shard]) -> dict[str, Shard]:
    """The replicated inputs of `op` holding, on one axis only, the dim its first split input is
    split on (the whole sequence, or the same merged rows), each split there; the op's rule then
    says whether they line up (a [seq, seq] mask, holding it twice, is not asked)."""
    at = next(((x, split[x]) for x in op.inputs if x in split), None)
    if at is None:
        return {}
    x0, s0 = at
    dim = _shape(p, x0)[s0.axis]
    want = {}
    for x in op.inputs:
        shape = _shape(p, x) if x else None
        if x in split or shape is None or p.vars[x].kind == "param":
            continue
        axes = [k for k, d in enumerate(shape) if d == dim]
        if len(axes) == 1:
            want[x] = Shard(axes[0], s0.blocks)
    return want


def _rule(
    p: Program, plan: SegmentPlan, op: Op, split: dict[str, Shard], why: list[str] | None = None
) -> ShardResult | None:
    tp_collective = op.type in _MODEL_PARALLEL_ELEMENTWISE and op.attrs.get("group") != plan.attrs()["group"]
    if plan.ring and tp_collective:
        rule = sharding.ShardRule(sharding._same)  # tensor parallel's, over the mp ranks at one position
    else:
        rule = sharding.token_rule(op.type)
        if rule is None or registry.get(op.type).collective:
            return None
    propagate = _ring_rule if plan.ring and rule.exchange else rule.propagate
    try:
        res = propagate(shard_args(p, op, split, plan.degree))
    except (sharding.ShardRefused, sharding.ShardNotImplemented) as e:
        if why is not None:
            why.append(str(e))
        return None
    if any(s is not None and any(b % plan.degree for b in s.blocks) for s in res.outputs):
        return None
    return res


# Tensor parallel's collectives act position by position over the model-parallel ranks, which hold
# the same positions of the sequence beside context parallel: the local sequence passes through them
_MODEL_PARALLEL_ELEMENTWISE = ("TPCopy", "TPReduce")


def _ring_rule(a: sharding.ShardArgs) -> ShardResult:
    """Attention on the local queries as a ring (context parallel): q, k and v split alike on the
    sequence (rank - 2); the mask whole (its rows are scattered where it spans the queries), so
    the output holds the local queries, split as q. Its dropout is drawn inside the ring op."""
    q, k, v = a.shards[:3]
    rank = len(a.shapes[0])
    if q is None or q != k or q != v or q.axis != rank - 2:
        raise sharding.ShardRefused(f"q, k and v are not split alike on the sequence ({q}, {k}, {v})")
    if len(a.shards) > 3 and a.shards[3] is not None:
        raise sharding.ShardRefused("its mask is split")
    if rank != 4:
        raise sharding.ShardRefused(f"its q is {rank}-D; the ring takes (batch, heads, seq, size)")
    return ShardResult([q if k == 0 else None for k in range(len(a.op.outputs))])


def _hoist(p: Program, plan: SegmentPlan, x: str, s: Shard, producers: dict) -> dict[str, Shard]:
    """What to scatter so that `x` is made on the local sequence: the inputs of its producer that
    hold the sequence, when that op makes `x` split as `s` from them; else `x` itself."""
    i = producers.get(x)
    if i is None or p.vars[x].kind != "activation":
        return {x: s}
    op = p.ops[i]
    ins: dict[str, Shard] = {}
    for v in op.inputs:
        shape = _shape(p, v)
        if not v or shape is None or p.vars[v].kind == "param":
            continue
        axes = [k for k, d in enumerate(shape) if d == plan.length]
        if len(axes) == 1:  # one place only: a [seq, seq] mask is not a chunk of tokens
            ins[v] = Shard(axes[0], (plan.length,))
    if not ins:
        return {x: s}
    res = _rule(p, plan, op, ins)
    if res is None or any(o == x and got != s for o, got in zip(op.outputs, res.outputs)):
        return {x: s}
    return ins


def _check_exchanges(p: Program, state: _State) -> None:
    """Attention reading the local sequence must be exchanged: gathering it whole on every rank
    would run every head over the whole sequence everywhere, which segment parallel exists to avoid."""
    for i, why in state.refused.items():
        rule = sharding.token_rule(p.ops[i].type)
        if rule is not None and rule.exchange:
            raise SegmentParallelError(
                f"segment_parallel: `{fmt_op(p.ops[i])}` reads the local sequence but cannot be exchanged "
                f"to whole sequences over a split of its heads (or run as a ring, for context parallel): "
                f"{why}"
            )


def _plan_exchanges(p: Program, plan: SegmentPlan) -> None:
    for i in sorted(plan.region):
        op = p.ops[i]
        rule = sharding.token_rule(op.type)
        if rule is not None and rule.exchange:
            rank = len(_shape(p, op.inputs[0]))
            plan.exchanges.append(Exchange(i, rank - 3, rank - 2))
            mask = op.inputs[3] if len(op.inputs) > 3 else ""
            rows = _mask_rows(p, mask)
            if plan.ring and mask and rows not in (1, plan.length):  # unknown, or another length
                raise NotImplementedError(
                    f"context_parallel: `{fmt_op(op)}`'s mask {mask!r} has {rows!r} rows, neither one nor "
                    f"the sequence's {plan.length}: which rows are the local queries' is not known"
                )


def _plan_losses(p: Program, plan: SegmentPlan) -> None:
    """Every loss over the local tokens (an op whose token row names its `labels`, reduced by mean
    or sum) is summed over the group where it is made (module doc), so whatever reads it (the
    program's loss itself, a scale, an auxiliary loss added to it) reads one process's value."""
    if p.loss_name and p.loss_name in plan.split:
        raise NotImplementedError(
            f"segment_parallel: the loss {p.loss_name!r} holds the local sequence's values; reduce "
            "it to a scalar (a mean or sum over tokens) in the model"
        )
    producers = p.producers()
    for i in sorted(plan.region):
        op = p.ops[i]
        rule = sharding.token_rule(op.type)
        reduction = op.attrs.get("reduction", "mean")
        if rule is None or rule.labels is None or reduction == "none":  # per token: split as its labels
            continue
        if reduction not in ("mean", "sum"):
            raise NotImplementedError(
                f"segment_parallel: `{fmt_op(op)}` reduces the local tokens by {reduction!r}; only mean "
                "and sum are summed over the group"
            )
        labels = _whole_source(p, plan, op.inputs[rule.labels], producers)
        ignore = op.attrs.get("ignore_index")
        plan.losses.append(LossPoint(i, labels, None if ignore is None else int(ignore)))


def _whole_source(p: Program, plan: SegmentPlan, x: str, producers: dict) -> str:
    """The scattered whole value the local labels `x` are made from, through one-input ops of the
    region (Identity, Reshape): every rank holds it, so each counts the whole batch's labels."""
    seen = x
    while seen not in plan.scatters:
        i = producers.get(seen)
        if i is None or i not in plan.region or len([v for v in p.ops[i].inputs if v in plan.split]) != 1:
            raise NotImplementedError(
                f"segment_parallel: the loss's labels {x!r} are not made from one scattered whole value "
                "by reshapes; counting the whole batch's labels from them is not built"
            )
        seen = next(v for v in p.ops[i].inputs if v in plan.split)
    return seen


def _plan_copies(p: Program, plan: SegmentPlan) -> None:
    """Replicated float inputs of split ops (params, and values made from them whole): read
    through TPCopy, whose backward sums their grads over the group."""
    graded = _made_from_params(p)
    for i in sorted(plan.region):
        op = p.ops[i]
        hosts = set(registry.host_inputs(op, p))
        for k, x in enumerate(op.inputs):
            if not x or x in plan.split or x in plan.copies or k in hosts or x not in graded:
                continue
            if torch_dtype(p.vars[x].dtype).is_floating_point:
                plan.copies[x] = i


def _made_from_params(p: Program) -> set[str]:
    """The params and the values computed from them: the ones a grad can reach (a mask or a
    position table made from feeds and constants carries none)."""
    made = {v.name for v in p.params()}
    for op in p.ops:
        if any(x in made for x in op.inputs if x):
            made.update(o for o in op.outputs if o)
    return made


def _plan_draws(p: Program, plan: SegmentPlan) -> None:
    exchanged = {e.op for e in plan.exchanges}
    for i, res in sorted(plan.region.items()):
        if not res.draws or (plan.ring and i in exchanged):  # a ring draws its own mask's rows
            continue
        op = p.ops[i]
        rows = i not in exchanged and not _plain(p, op.outputs[0], plan.split[op.outputs[0]])
        if sharding.sequence_kind(op) != "sliced_draw" or rows:
            raise NotImplementedError(
                f"segment_parallel: `{fmt_op(op)}` draws random numbers on the local sequence; only "
                "Dropout and attention draw one process's mask there so far"
            )
        plan.draws.append(i)


def _check_outputs(p: Program, plan: SegmentPlan) -> None:
    leaving = [x for x in [*p.outputs, *p.updates.values()] if x in plan.split and x != p.loss_name]
    if leaving:
        raise NotImplementedError(
            f"segment_parallel: the value {leaving[0]!r} on the local sequence is a program output; "
            "gathering an output back whole is not built (fetch the loss, or a value before the split)"
        )


_MERGED = re.compile(r"^\s*(\d+)\s*\*\s*([A-Za-z_]\w*)\s*$|^\s*([A-Za-z_]\w*)\s*\*\s*(\d+)\s*$")


def local_dim(d: int | str, s: Shard, degree: int) -> int | str:
    """Dim `d` of a value split as `s` on this rank: the chunk of the sequence, or of the rows
    merging [batch, seq] (``"12*batch"`` -> ``"6*batch"``)."""
    whole = sum(s.blocks)
    if d == whole:
        return s.local(degree)
    m = _MERGED.match(d) if isinstance(d, str) else None
    if m is not None:
        n, sym = (int(m[1]), m[2]) if m[1] else (int(m[4]), m[3])
        if n % whole == 0:
            return f"{n // whole * s.local(degree)}*{sym}"
    if isinstance(d, int) and d % whole == 0:
        return d // whole * s.local(degree)
    raise NotImplementedError(
        f"segment_parallel: dim {d!r} split in blocks of {whole}: its local size is not built"
    )


def _local_shape(shape: tuple, s: Shard, degree: int) -> tuple:
    return tuple(local_dim(d, s, degree) if k == s.axis else d for k, d in enumerate(shape))


def _check_local_shapes(p: Program, plan: SegmentPlan) -> None:
    for x, s in plan.split.items():
        shape = _shape(p, x)
        if shape is not None:
            _local_shape(shape, s, plan.degree)  # raises, naming the dim, where it cannot be said


def _describe(p: Program, plan: SegmentPlan) -> None:
    ev = plan.events
    local = plan.length // plan.degree
    for x, s in plan.scatters.items():
        ev.append(f"scatter  {x} -> {names.sp_scattered(x)}  (axis {s.axis}: seq {plan.length} -> {local}; "
                  "backward: all-gather)")  # fmt: skip
    for e in plan.exchanges:
        op = p.ops[e.op]
        if plan.ring:
            mask = op.inputs[3] if len(op.inputs) > 3 and op.inputs[3] else ""
            spans = _mask_rows(p, mask) == plan.length
            rows = f"; mask {mask}: its rows of the local queries" if spans else ""
            hops = f"{plan.degree - 1} hop" + ("s" if plan.degree > 2 else "")
            ev.append(f"ring     {op.outputs[0]}: the local queries over the whole sequence, k and v round "
                      f"the ring ({hops}; RingAttention){rows}")  # fmt: skip
            continue
        ev.append(f"exchange {op.outputs[0]}: q, k, v all-to-all to whole sequences over 1/{plan.degree} of "
                  "the heads, the output back (SepAllToAll)")  # fmt: skip
    for x in plan.gathers:
        ev.append(
            f"gather   {x} -> {names.sp_gathered(x)}  (read whole by `{fmt_op(p.ops[plan.gathers[x]])}`)"
        )
    for point in plan.losses:
        op = p.ops[point.op]
        ev.append(f"loss     {op.outputs[0]}: the local tokens' sum / the whole batch's count of "
                  f"{point.labels} (every rank's), summed over the group (TPReduce)")  # fmt: skip
    for x in plan.copies:
        ev.append(f"TPCopy   {x}  (read on the local sequence: its grad summed over the group)")
    for i in plan.draws:
        ev.append(f"dropout  {p.ops[i].outputs[0]}: one process's mask (drawn whole from the shared stream, "
                  "this rank's part kept)")  # fmt: skip


# --- rewrite ---------------------------------------------------------------------------------


def segment_parallel(p: Program, *, plan: SegmentPlan) -> Program:
    """A copy of `p` rewritten for `plan` (module doc): one sweep, the new ops placed by the plan's
    indices (a scatter right after its value's producer, a gather or TPCopy right before its
    value's first reader, the exchanges around their attention, the loss's sum after it)."""
    q = p.clone()
    for name, s in plan.split.items():
        if name not in plan.scatters:  # a source keeps its whole value; its chunk is a new var
            q.vars[name].shape = _local_shape(tuple(p.vars[name].shape), s, plan.degree)
    new = _new_vars(p, q, plan)
    before, after, start = _placed_ops(p, plan, new)
    exchanges = {e.op: e for e in plan.exchanges}
    losses = {point.op: point for point in plan.losses}
    attrs = plan.attrs()
    mask_rows: dict[str, str] = {}  # a ring's mask -> its rows of the local queries (scattered once)
    ops: list[Op] = [_feeds_agree(q, plan), *start]
    for i, op in enumerate(q.ops):
        ops += before.get(i, [])
        if i in plan.region:
            op.inputs = [new["scatter"].get(x, new["copy"].get(x, x)) if x else x for x in op.inputs]
            rewrite_constants(q, op, plan.region[i].constants, plan.region[i].attrs)
        else:
            op.inputs = [new["gather"].get(x, x) if x else x for x in op.inputs]
        if i in plan.draws:
            e = exchanges.get(i)
            axis = e.heads_axis if e is not None else plan.split[op.outputs[0]].axis
            op.attrs.update({"rng": "shared", "slice_axis": axis, "slice_group": attrs["group"]})
            if e is None and plan.layout != "contiguous":
                op.attrs["slice_layout"] = plan.layout
        if i in exchanges and plan.ring:
            ops += _ringed(q, op, plan, mask_rows)
        elif i in exchanges:
            ops += _exchanged(q, op, exchanges[i], plan)
        elif i in losses:
            ops += _summed_loss(q, op, plan, losses[i])
        else:
            ops.append(op)
        ops += after.get(i, [])
    q.ops = ops
    drop_unread_constants(p, q)
    q.sort_vars()
    return q


def _feeds_agree(q: Program, plan: SegmentPlan) -> Op:
    """The first op: every rank of the group checks, on the first run, that it was fed the same
    batch as the others (a rank fed its own would train on no batch at all, silently)."""
    out = names.fresh(names.sep_feeds_checked(), q.vars)
    q.add_var(Var(out, "bool", ()))
    feeds = list(q.inputs)
    return Op("FeedsAgree", feeds, [out], {"names": feeds, **plan.attrs()}, role=roles.FORWARD)


def _new_vars(p: Program, q: Program, plan: SegmentPlan) -> dict[str, dict[str, str]]:
    new: dict[str, dict[str, str]] = {"scatter": {}, "gather": {}, "copy": {}}

    def add(kind: str, x: str, name: str, shape) -> None:  # noqa: ANN001
        new[kind][x] = names.fresh(name, q.vars)
        q.add_var(Var(new[kind][x], p.vars[x].dtype, shape))

    for x, s in plan.scatters.items():
        add("scatter", x, names.sp_scattered(x), _local_shape(tuple(p.vars[x].shape), s, plan.degree))
    for x in plan.gathers:
        add("gather", x, names.sp_gathered(x), p.vars[x].shape)
    for x in plan.copies:
        add("copy", x, names.tp_copy(x), p.vars[x].shape)
    return new


def _kw(p: Program, i: int | None, origin: str) -> dict:
    if i is None:
        return {"role": roles.FORWARD, "origin": origin}
    op = p.ops[i]
    return {"role": op.role, "scope": op.scope, "origin": origin}


def _placed_ops(p: Program, plan: SegmentPlan, new: dict) -> tuple[dict, dict, list]:
    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    start: list[Op] = []
    producers = p.producers()
    group = plan.attrs()["group"]
    for x, s in plan.scatters.items():
        i = producers.get(x)
        attrs = {"axis": s.axis, "group": group, **plan.layout_attrs()}
        op = Op("SPScatter", [x], [new["scatter"][x]], attrs, **_kw(p, i, x))
        (after.setdefault(i, []) if i is not None else start).append(op)
    for x, i in plan.copies.items():
        op = Op("TPCopy", [x], [new["copy"][x]], {"group": group}, **_kw(p, i, x))
        before.setdefault(i, []).append(op)
    for x, i in plan.gathers.items():
        s = plan.split[x]
        if not _plain(p, x, s):
            raise NotImplementedError(
                f"segment_parallel: `{fmt_op(p.ops[i])}` reads {x!r} whole, which holds the rows of merged "
                "[batch, seq] dims on the local sequence; gathering those is not built"
            )
        attrs = {"axis": s.axis, "group": group, "backward": "scatter", **plan.layout_attrs()}
        op = Op("SPGather", [x], [new["gather"][x]], attrs, **_kw(p, i, x))
        before.setdefault(i, []).append(op)
    return before, after, start


def _exchanged(q: Program, op: Op, e: Exchange, plan: SegmentPlan) -> list[Op]:
    """SepAllToAll of q, k and v (sequence whole, heads split), the attention on them, and its
    output exchanged back to the local sequence under its own name."""
    kw = {"role": op.role, "scope": op.scope}
    group = plan.attrs()["group"]
    out: list[Op] = []
    heads: dict[str, str] = {}
    for x in op.inputs[:3]:
        if x in heads:
            continue
        heads[x] = names.fresh(names.sep_heads(x), q.vars)
        q.add_var(Var(heads[x], q.vars[x].dtype, _exchange_shape(q.vars[x].shape, e, plan.degree)))
        out.append(Op("SepAllToAll", [x], [heads[x]],
                      {"scatter_axis": e.heads_axis, "gather_axis": e.seq_axis, "group": group},
                      origin=x, **kw))  # fmt: skip
    y = op.outputs[0]
    y_heads = names.fresh(names.sep_heads(y), q.vars)
    q.add_var(Var(y_heads, q.vars[y].dtype, _exchange_shape(q.vars[y].shape, e, plan.degree)))
    op.inputs = [heads.get(x, x) if k < 3 else x for k, x in enumerate(op.inputs)]
    op.outputs = [y_heads, *op.outputs[1:]]
    out.append(op)
    out.append(Op("SepAllToAll", [y_heads], [y],
                  {"scatter_axis": e.seq_axis, "gather_axis": e.heads_axis, "group": group},
                  origin=y, **kw))  # fmt: skip
    return out


def _mask_rows(p: Program, mask: str) -> int | str | None:
    """How many rows attention's `mask` has (dim -2; None: no mask, or not known). One spanning
    the sequence has its rows scattered before a ring."""
    shape = _shape(p, mask) if mask else None
    return shape[-2] if shape is not None and len(shape) >= 2 else None


def _ringed(q: Program, op: Op, plan: SegmentPlan, mask_rows: dict[str, str]) -> list[Op]:
    """Attention on the local queries as `RingAttention` (ops/kernels/context_parallel.py), its
    mask's rows of the local queries scattered first (once per mask)."""
    kw = {"role": op.role, "scope": op.scope}
    out: list[Op] = []
    inputs = list(op.inputs[:4])
    mask = inputs[3] if len(inputs) > 3 else ""
    if mask and _mask_rows(q, mask) == plan.length:  # the plan refused any other row count
        if mask not in mask_rows:
            mask_rows[mask] = names.fresh(names.sp_scattered(mask), q.vars)
            shape = list(q.vars[mask].shape)
            shape[-2] = plan.length // plan.degree
            q.add_var(Var(mask_rows[mask], q.vars[mask].dtype, tuple(shape)))
            attrs = {"axis": len(shape) - 2, **plan.attrs(), **plan.layout_attrs()}
            out.append(Op("SPScatter", [mask], [mask_rows[mask]], attrs, origin=mask, **kw))
        inputs[3] = mask_rows[mask]
    dropout_p = float(op.attrs.get("dropout_p", 0.0))
    if dropout_p > 0.0 and op.attrs.get("rng", "shared") != "shared":
        raise NotImplementedError(
            f"context_parallel: `{fmt_op(op)}` draws its dropout from the {op.attrs['rng']!r} RNG stream "
            "(tensor parallel's own mask per rank); beside context parallel attention draws one process's "
            "mask: set tensor_parallel_configs['one_process_dropout'] = True"
        )
    # tensor parallel's heads: one process's mask is drawn over every head, this rank's kept
    heads = {"heads_group": op.attrs["slice_group"]} if op.attrs.get("slice_axis") is not None else {}
    if heads and op.attrs["slice_axis"] != 1:
        raise NotImplementedError(f"context_parallel: `{fmt_op(op)}` slices its mask on axis "
                                  f"{op.attrs['slice_axis']}, not its heads")  # fmt: skip
    attrs = {
        "scale": op.attrs.get("scale", 1.0),
        "dropout_p": dropout_p,
        **plan.attrs(),
        "layout": plan.layout,
        "length": plan.length,
        **({"rng": "shared", **heads} if dropout_p > 0.0 else {}),
    }
    out.append(Op("RingAttention", inputs, op.outputs[:1], attrs, **kw))
    return out


def _exchange_shape(shape, e: Exchange, degree: int) -> tuple:  # noqa: ANN001
    """A local-sequence q/k/v/output shape after the exchange: heads / degree, the sequence whole."""
    out = list(shape)
    h = out[e.heads_axis]
    if not isinstance(h, int) or h % degree:
        raise SegmentParallelError(f"segment_parallel: {h} heads are not divisible by sep_degree {degree}")
    out[e.heads_axis] = h // degree
    out[e.seq_axis] = out[e.seq_axis] * degree
    return tuple(out)


def _summed_loss(q: Program, op: Op, plan: SegmentPlan, point: LossPoint) -> list[Op]:
    """The loss op summing over the local tokens, divided by the whole batch's count, summed over
    the group (module doc). Mean: the count of labels other than ignore_index, divided in float32
    at least (a 16-bit count is inexact past 256 or 2048 tokens)."""
    loss = op.outputs[0]
    kw = {"role": op.role, "scope": op.scope, "origin": loss}
    dtype = q.vars[loss].dtype
    shape = q.vars[loss].shape
    local = names.fresh(names.sep_partial(loss), q.vars)
    q.add_var(Var(local, dtype, shape))
    out: list[Op] = []
    if op.attrs.get("reduction", "mean") == "mean":
        wide = dtype if dtype in ("float32", "float64") else "float32"
        summed = names.fresh(names.sep_summed(loss), q.vars)
        q.add_var(Var(summed, dtype, shape))
        op.attrs["reduction"] = "sum"
        op.outputs = [summed, *op.outputs[1:]]
        out.append(op)
        count = _count_ops(q, point, wide, kw, out)
        if wide == dtype:
            out.append(Op("Div", [summed, count], [local], {}, **kw))
        else:  # the sum widened, divided, narrowed back
            widened, divided = (names.fresh(names.sep_summed(loss), q.vars) for _ in range(2))
            q.add_var(Var(widened, wide, shape))
            out.append(Op("Cast", [summed], [widened], {"to": TORCH_TO_ONNX[torch_dtype(wide)]}, **kw))
            q.add_var(Var(divided, wide, shape))
            out.append(Op("Div", [widened, count], [divided], {}, **kw))
            out.append(Op("Cast", [divided], [local], {"to": TORCH_TO_ONNX[torch_dtype(dtype)]}, **kw))
    else:
        op.outputs = [local, *op.outputs[1:]]
        out.append(op)
    out.append(Op("TPReduce", [local], [loss], {"group": plan.attrs()["group"]}, **kw))
    return out


def _count_ops(q: Program, point: LossPoint, dtype: str, kw: dict, out: list[Op]) -> str:
    """Ops counting the whole labels other than ignore_index (each rank holds them whole)."""
    labels = point.labels
    kept = labels
    if point.ignore_index is not None:
        ignore = names.fresh(names.sep_ignore_index(labels), q.vars)
        q.add_var(Var(ignore, q.vars[labels].dtype, (), kind="constant"),
                  torch.tensor(point.ignore_index, dtype=torch_dtype(q.vars[labels].dtype)))  # fmt: skip
        same = names.fresh(names.sep_ignored(labels), q.vars)
        q.add_var(Var(same, "bool", q.vars[labels].shape))
        out.append(Op("Equal", [labels, ignore], [same], {}, **kw))
        kept = names.fresh(names.sep_counted(labels), q.vars)
        q.add_var(Var(kept, "bool", q.vars[labels].shape))
        out.append(Op("Not", [same], [kept], {}, **kw))
    flags = names.fresh(names.sep_flags(labels), q.vars)
    q.add_var(Var(flags, dtype, q.vars[labels].shape))
    out.append(Op("Cast", [kept], [flags], {"to": TORCH_TO_ONNX[torch_dtype(dtype)]}, **kw))
    count = names.fresh(names.sep_count(labels), q.vars)
    q.add_var(Var(count, dtype, ()))
    out.append(Op("ReduceSum", [flags], [count], {"keepdims": 0}, **kw))
    return count

"""Tensor (model) parallel with Megatron's semantics, as a rewrite of the forward program by var name.

    plan = plan_tensor_parallel(program, mp_degree=2, mp_rank=rank, group=[0, 1],
                                column=["transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc"],
                                row=["transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"],
                                vocab=["transformer.wte"])   # optional: the table split by vocab rows
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
  refuses, stops the pass with an error naming the op's printed line and why.
* MP-aware RNG (Megatron's / Paddle's model-parallel RNG tracker): every random op gets the
  stream it draws from as attrs (metaopt/ops/rng_streams.py). One that draws on a split value
  (dropout on this rank's heads: its rule says ``draws``) gets ``rng="model_parallel",
  group=<the MP group>``: a generator per MP rank (this worker's place in the group, found at run
  time, so every rank's program prints the same), seeded ``seed + 2718 + r``, so each rank drops
  its slice with its own mask. Every other one (on replicated values) gets ``rng="shared"``: torch's default
  generator, seeded alike on every rank, so replicated values stay identical across the group.
  The plan lists the model-parallel ones; the printed program shows both.
* A row-parallel Linear keeps this rank's columns of its weight (in the layout its split input
  has); it computes a partial product without bias, ``TPReduce`` (Megatron's g: all-reduce sum
  forward, identity backward) sums it over the group, and the full bias is added once after, as
  Megatron's RowParallelLinear does. The Add writes the layer's original output name.
* A split value must end in a row-parallel layer: one that reaches a program output is refused.
* `vocab` (Megatron's VocabParallelEmbedding + vocab-parallel cross-entropy) names tables [V, H]
  split by vocab rows: an embedding module (its lookup's table; a head tied to it follows), a
  module with its own ``<module>.weight`` (an untied LM head, whose output the fused loss
  absorbed), or a param. Rank r keeps rows [r V/mp, (r+1) V/mp); V not divisible by mp is refused
  naming the table. Every reader of the table is rewritten, or refused naming its printed line
  (ops/vocab_parallel.py): a lookup becomes ``VocabParallelEmbedding`` (its rows, zeros for the
  others) + ``TPReduce``; the fused head + loss (``LinearCrossEntropy``: run
  fuse_linear_cross_entropy first) becomes ``VocabParallelLinearCrossEntropy`` with its input
  through ``TPCopy``: this rank's vocab slice of the logits only, one all-reduce inside
  (ops/kernels/vocab_parallel.py). The new ops carry the group, not the rank: the kernels find
  the rank's rows at run time, so every rank's program prints the same.

The pass is pure and runs on the forward program, before append_backward: the backward comes
from the gradient rules (TPCopy's is a TPReduce, TPReduce's an Identity). Each rank applies it
with its own `mp_rank`; every rank of the group must be fed the same batch. `unshard` puts a
param's per-rank slices back together (in rank order), the inverse of the slicing here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from metaopt.ir import Op, Program, Split, Var, did_you_mean, names, roles
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry, rng_streams, sharding, vocab_parallel
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
class VocabOp:
    """A reader of a vocab-split table, rewritten over this rank's rows: a lookup (kind
    "embedding": VocabParallelEmbedding, then TPReduce) or the fused LM head + loss (kind "loss":
    VocabParallelLinearCrossEntropy, its input `x` through TPCopy)."""

    index: int
    kind: str  # "embedding" | "loss"
    table: str
    inputs: tuple[str, ...]  # the new op's inputs (x, before its TPCopy, for the loss)
    out: str
    attrs: dict  # the new op's attrs: the vocab_size and the group among them
    x: str = ""  # the loss's hidden states (copied through TPCopy); "" for a lookup


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
    vocab: dict[int, VocabOp] = field(default_factory=dict)
    rng: dict[int, dict] = field(default_factory=dict)  # random op index -> its stream attrs
    params: list[SplitParam] = field(default_factory=list)
    sharded: dict[str, Shard] = field(default_factory=dict)  # split activations (full layout)
    events: list[str] = field(default_factory=list)  # what the rewrite does, in program order
    skipped: list[str] = field(default_factory=list)
    one_process_dropout: bool = False  # random ops on split values draw one process's mask, sliced

    def __str__(self) -> str:
        kinds = [layer.kind for layer in self.layers.values()]
        head = (
            f"tensor_parallel: mp_degree={self.mp_degree} mp_rank={self.mp_rank} group={list(self.group)}: "
            f"{kinds.count('column')} column and {kinds.count('row')} row layers, {len(self.params)} params "
            f"split, {len(self.changes)} ops rewritten"
        )
        if self.vocab:
            tables = len({v.table for v in self.vocab.values()})
            head += f"; {tables} vocab-split table(s) read by {len(self.vocab)} op(s)"
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
    vocab: Sequence[str] = (),
    one_process_dropout: bool = False,
) -> TensorParallelPlan:
    """Which params split how, which collectives go where, which ops change (module doc);
    `vocab`: embeddings (module paths or patterns) or params whose table is split by vocab rows;
    `one_process_dropout`: a random op on a split value draws one process's mask (the whole mask
    from the shared stream, this rank's slice kept) instead of this rank's own stream."""
    _check_args(p, mp_degree, mp_rank, group)
    plan = TensorParallelPlan(mp_degree, mp_rank, tuple(group), one_process_dropout=one_process_dropout)
    producers, consumers = p.producers(), p.consumers()
    cols, rows = _resolve(p, column, "column", producers), _resolve(p, row, "row", producers)
    kinds = {**cols, **rows}
    both = set(cols) & set(rows)
    if both:
        i = min(both)
        raise TensorParallelError(f"`{fmt_op(p.ops[i])}` is named both column- and row-parallel")
    copied: set[str] = set()
    readers = _vocab_readers(p, plan, _resolve_vocab(p, vocab, producers), consumers, set(kinds))
    for i, op in enumerate(p.ops):
        kind = kinds.get(i)
        if i in readers:
            _plan_vocab(p, plan, readers[i], copied)
        elif kind == "column":
            _plan_column(p, plan, i, consumers, copied)
        elif kind == "row":
            _plan_row(p, plan, i, consumers)
        elif any(x in plan.sharded for x in op.inputs if x):
            _plan_through(p, plan, i)
        elif sharding.linear_parts(op) is not None:
            plan.skipped.append(f"{op.outputs[0]}: a Linear not named in column or row (replicated)")
        if i not in plan.rng and _random(op) and not any(x in plan.sharded for x in op.inputs if x):
            plan.rng[i] = rng_streams.shared_attrs()  # replicated: the stream the group shares
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
            i = _linear_behind(p, producers.get(v), producers)
            if i is None or sharding.linear_parts(p.ops[i]) is None:
                what = f"`{fmt_op(p.ops[i])}`" if i is not None else "no op (an input or param)"
                raise TensorParallelError(f"{kind} layer {pattern!r}: {v!r} is made by {what}, not a Linear")
            out[i] = kind
    return out


def _linear_behind(p: Program, i: int | None, producers: dict[str, int]) -> int | None:
    """The linear layer a module's output comes from: op `i` itself, or the one behind the Reshapes
    that put a 2-D Gemm's rows back into [B, S, F] (Hugging Face's Conv1D module output)."""
    at = i
    while at is not None and sharding.linear_parts(p.ops[at]) is None:
        op = p.ops[at]
        src = producers.get(op.inputs[0]) if op.inputs else None
        if src is None or not sharding.keeps_features(op, _shape(p, op.inputs[0]), _shape(p, op.outputs[0])):
            return i
        at = src
    return at


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
    axis = sharding.weight_out_axis(op)  # [out, in]: its rows; HF Conv1D's [in, out]: its columns
    texts = [_split_param(p, plan, w, out, axis, blocks)]
    if b:
        texts.append(_split_param(p, plan, b, out, 0, blocks))
    what = "rows" if axis == 0 else "columns"
    layout = f"{len(blocks)} blocks {list(blocks)}, 1/{mp} of each" if len(blocks) > 1 else what
    plan.events.append(f"column   {out}: {', '.join(texts)}  ({layout})")
    rank = len(p.vars[out].shape)
    plan.sharded[out] = Shard(rank - 1, blocks)


def _column_blocks(p: Program, out: str, consumers: dict[str, list[int]]) -> tuple[int, ...]:
    """One block, or the pieces a Split right after cuts the features into (a fused q, k, v),
    looking through Reshapes that keep the features (a 2-D Gemm's output back to [B, S, F])."""
    full = p.vars[out].shape
    readers = consumers.get(out, [])
    while len(readers) == 1 and sharding.keeps_features(
        p.ops[readers[0]], _shape(p, out), _shape(p, p.ops[readers[0]].outputs[0])
    ):
        out = p.ops[readers[0]].outputs[0]
        full, readers = p.vars[out].shape, consumers.get(out, [])
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
    axis = 1 - sharding.weight_out_axis(op)  # the weight's input features
    text = _split_param(p, plan, w, out, axis, s.blocks)
    bias = f"; bias {b} added once after the all-reduce" if b else ""
    plan.events.append(f"row      {out}: {text}  ({'columns' if axis == 1 else 'rows'}){bias}")
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
    args = shard_args(p, op, plan.sharded, plan.mp_degree)
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
    if res.draws and plan.one_process_dropout:
        plan.rng[i] = _one_process_draw(p, plan, op, args.shards)
        plan.events.append(
            f"rng      {op.outputs[0]}: {op.type} draws one process's mask (drawn whole from the shared "
            f"stream, this rank's slice of axis {plan.rng[i]['slice_axis']} kept)"
        )
    elif res.draws:  # its own mask on this rank's slice: the rank's model-parallel stream
        r = plan.mp_rank
        plan.rng[i] = rng_streams.model_parallel_attrs(plan.group)
        plan.events.append(
            f"rng      {op.outputs[0]}: {op.type} draws from the model-parallel RNG stream of rank {r} "
            f"(seed + {rng_streams.MP_SEED_OFFSET} + {r})"
        )


def _one_process_draw(p: Program, plan: TensorParallelPlan, op: Op, shards: list) -> dict:
    """The attrs of a random op on a split value drawing one process's mask (its row must say it
    can: ``sequence="sliced_draw"``), sliced along its first input's split axis."""
    s = shards[0]
    if sharding.sequence_kind(op) != "sliced_draw" or s is None or len(s.blocks) != 1:
        one_block = s is not None and len(s.blocks) == 1
        why = "its row draws no sliced mask" if one_block else "its input is split in blocks"
        raise NotImplementedError(
            f"tensor parallel: `{fmt_op(op)}` cannot draw one process's mask ({why}); "
            "leave one_process_dropout off (each rank draws its own)"
        )
    return {**rng_streams.shared_attrs(), "slice_axis": s.axis, "slice_group": list(plan.group)}


def _random(op: Op) -> bool:
    row = registry.get(op.type)
    return row is not None and row.random


def shard_args(p: Program, op: Op, split: dict[str, Shard], mp: int) -> ShardArgs:
    """What a split rule (ops/sharding.py) sees of `op` in `p`, its inputs split as `split` says
    (sequence parallel asks the same rules about the sequence axis)."""
    return ShardArgs(
        op=op,
        shards=[split.get(x) if x else None for x in op.inputs],
        shapes=[_shape(p, x) for x in op.inputs],
        out_shapes=[_shape(p, o) for o in op.outputs],
        mp=mp,
        constant=lambda name: _constant(p, name),
    )


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


# --- vocab parallel: tables split by vocab rows, their lookups and the LM head + loss -------------


def _resolve_vocab(p: Program, patterns: Sequence[str], producers: dict[str, int]) -> list[str]:
    """The tables the `vocab` entries name, in order: a param by name; a module (path or pattern)
    whose output an embedding lookup makes: its table; a module whose weight ``<module>.weight``
    is a param (an untied LM head, whose module output the fused loss absorbed)."""
    params = {v.name for v in p.params()}
    out: list[str] = []
    for pattern in patterns:
        found = [pattern] if pattern in params else _vocab_lookups(p, pattern, producers)
        if not found:
            found = [f"{m}.weight" for m in _param_modules(params, pattern)]
        if not found:
            raise TensorParallelError(
                f"vocab layer {pattern!r} is neither an embedding module, nor a module with a weight, nor "
                f"a param of {p.name!r}{did_you_mean(pattern, [*p.modules, *sorted(params)])}"
            )
        out += [t for t in found if t not in out]
    return out


def _vocab_lookups(p: Program, pattern: str, producers: dict[str, int]) -> list[str]:
    """The tables of the lookups making the outputs of the modules `pattern` names ([] when it names
    no module, or a module with its own ``<module>.weight``, which `_param_modules` finds)."""
    try:
        found = resolve_checkpoints(p, [pattern])
    except RecomputeError:
        return []
    tables = []
    for v in found:
        i = producers.get(v)
        try:
            look = vocab_parallel.lookup(p.ops[i]) if i is not None else None
        except vocab_parallel.NotVocabParallel as e:
            raise TensorParallelError(f"vocab layer {pattern!r}: `{fmt_op(p.ops[i])}`: {e}") from None
        if look is None or p.vars[look.table].kind != "param":
            if f"{pattern}.weight" in p.vars:
                return []  # a head named by its module: its weight, found by _param_modules
            what = f"`{fmt_op(p.ops[i])}`" if i is not None else "no op (an input or param)"
            raise TensorParallelError(
                f"vocab layer {pattern!r}: {v!r} is made by {what}, not an embedding lookup of a param; name "
                "the embedding (a head tied to it follows) or an LM head's module (its '<module>.weight')"
            )
        tables.append(look.table)
    return tables


def _param_modules(params: set[str], pattern: str) -> list[str]:
    """Modules matching `pattern` (one path component per ``*``) that own a ``weight`` param."""
    parts = pattern.split(".")
    mods = sorted({n[: -len(".weight")] for n in params if n.endswith(".weight")})
    return [
        m
        for m in mods
        if len(m.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(a, b) for a, b in zip(m.split("."), parts))
    ]


def _vocab_readers(
    p: Program, plan: TensorParallelPlan, tables: list[str], consumers: dict, layer_ops: set[int]
) -> dict[int, VocabOp]:
    """Every op reading a vocab-split table, as the op it becomes; anything else reading one is
    refused naming its printed line (ops/vocab_parallel.py says which readers are possible)."""
    mp = plan.mp_degree
    out: dict[int, VocabOp] = {}
    for t in tables:
        shape = p.vars[t].shape
        if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
            raise TensorParallelError(
                f"vocab-split table {t!r} has shape {shape}, not a static [vocab, hidden]"
            )
        if shape[0] % mp:
            raise TensorParallelError(
                f"vocab-split table {t!r} has {shape[0]} rows (its vocab), not divisible by mp_degree {mp}; "
                "pad the vocab to a multiple of it (Megatron's make-vocab-size-divisible-by)"
            )
        for i in consumers.get(t, []):
            out[i] = _vocab_reader(p, i, t, shape[0], plan, consumers, layer_ops)
    return out


def _vocab_reader(
    p: Program, i: int, t: str, size: int, plan: TensorParallelPlan, consumers, layer_ops
) -> VocabOp:
    op = p.ops[i]
    # No rank-specific attr (the kernels find this worker's rows from its place in the group):
    # every rank's program reads the same, as fleet checks.
    where = {"vocab_size": size, "group": list(plan.group)}
    try:
        if i in layer_ops:
            raise vocab_parallel.NotVocabParallel("it is named a column- or row-parallel layer too")
        look = vocab_parallel.lookup(op)
        if look is not None and look.table == t:
            return VocabOp(i, "embedding", t, (t, look.ids), op.outputs[0], {**where, **look.attrs})
        head = vocab_parallel.head_loss(op)
        if head is not None and head.weight == t:
            if head.bias:
                _sole_reader(p, "vocab", op, head.bias, consumers)
            attrs = {**where, **head.attrs}
            ins = (head.x, t, head.labels) + ((head.bias,) if head.bias else ())
            return VocabOp(i, "loss", t, ins, op.outputs[0], attrs, x=head.x)
    except vocab_parallel.NotVocabParallel as e:
        raise TensorParallelError(f"`{fmt_op(op)}` reads the vocab-split table {t!r}: {e}") from None
    raise TensorParallelError(
        f"`{fmt_op(op)}` reads the vocab-split table {t!r}, but only an embedding lookup or the fused LM "
        "head + loss (LinearCrossEntropy) can read its vocab slice: the full-vocab value would be needed on "
        "every rank. An unfused LM head: fuse it first (strategy.fuse_linear_cross_entropy=True, or "
        "passes.fuse_linear_cross_entropy with min_classes=1)"
    )


def _plan_vocab(p: Program, plan: TensorParallelPlan, v: VocabOp, copied: set[str]) -> None:
    op, mp = p.ops[v.index], plan.mp_degree
    size = v.attrs["vocab_size"] // mp
    rows = f"vocab rows [{plan.mp_rank * size}, {(plan.mp_rank + 1) * size})"
    if all(sp.name != v.table for sp in plan.params):
        text = _split_param(p, plan, v.table, v.out, 0, (v.attrs["vocab_size"],))
        plan.events.append(f"vocab    {text}  ({rows})")
    if v.kind == "embedding":
        plan.events.append(
            f"lookup   {v.out}: {vocab_parallel.EMBEDDING_OP} in {rows} (zeros elsewhere), then "
            f"TPReduce {names.tp_partial(v.out)} -> {v.out}  (all-reduce sum; backward: identity; the "
            "table's grad: its rows only)"
        )
    else:
        if v.x in plan.sharded:
            raise TensorParallelError(f"`{fmt_op(op)}`: the LM head's input {v.x!r} is itself split")
        if len(v.inputs) > 3:
            plan.events.append(
                f"vocab    {_split_param(p, plan, v.inputs[3], v.out, 0, (v.attrs['vocab_size'],))}"
            )
        if v.x not in copied:
            copied.add(v.x)
            plan.events.append(
                f"TPCopy   {v.x} -> {names.tp_copy(v.x)}  (identity; backward: all-reduce sum)"
            )
        plan.events.append(
            f"loss     {v.out}: {vocab_parallel.LOSS_OP} over {rows}  (one all-reduce of each rank's "
            "logsumexp and target logits; backward local)"
        )
    plan.vocab[v.index] = v


# --- rewrite ---------------------------------------------------------------------------------


def tensor_parallel(p: Program, *, plan: TensorParallelPlan) -> Program:
    """A copy of `p` rewritten for `plan`'s rank: params sliced, TPCopy / TPReduce inserted, shape
    constants rewritten, split activations given their local shapes (module doc)."""
    q = p.clone()
    mp, rank = plan.mp_degree, plan.mp_rank
    for sp in plan.params:  # the rank's slice of each split param, the var's shape to match
        q.values[sp.name] = shard_tensor(q.values[sp.name], sp.axis, sp.blocks, mp, rank)
        q.vars[sp.name].shape = sp.local_shape
        # the layout, in the var: checkpoints save and load it by full shape (fleet/sharded_io.py),
        # and the optimizer's state of this param inherits it (passes/optimize.py)
        q.vars[sp.name].split = Split(sp.axis, mp, tuple(sp.blocks))
    for name, s in plan.sharded.items():
        q.vars[name].shape = s.local_shape(tuple(p.vars[name].shape), mp)
    ops: list[Op] = []
    copies: dict[str, str] = {}
    for i, op in enumerate(q.ops):
        layer = plan.layers.get(i)
        if i in plan.vocab:
            ops += _rewrite_vocab(q, op, plan.vocab[i], plan, copies)
        elif layer is not None and layer.kind == "column":
            ops += _rewrite_column(q, op, layer, plan, copies)
        elif layer is not None:
            ops += _rewrite_row(q, op, layer, plan)
        else:
            if i in plan.changes:
                rewrite_constants(q, op, plan.changes[i].constants, plan.changes[i].attrs)
            op.attrs.update(plan.rng.get(i, {}))
            ops.append(op)
    q.ops = ops
    drop_unread_constants(p, q)
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


def _rewrite_vocab(q: Program, op: Op, v: VocabOp, plan: TensorParallelPlan, copies: dict) -> list[Op]:
    kw = {"role": op.role, "scope": op.scope, "origin": op.origin}
    if v.kind == "embedding":
        out = q.vars[v.out]
        partial = names.fresh(names.tp_partial(v.out), q.vars)
        q.add_var(Var(partial, out.dtype, out.shape))
        return [
            Op(vocab_parallel.EMBEDDING_OP, list(v.inputs), [partial], dict(v.attrs), **kw),
            Op("TPReduce", [partial], [v.out], {"group": list(plan.group)}, **kw),
        ]
    new = []
    if v.x not in copies:  # one TPCopy per replicated value, shared with column layers reading it
        xv = q.vars[v.x]
        copies[v.x] = names.fresh(names.tp_copy(v.x), q.vars)
        q.add_var(Var(copies[v.x], xv.dtype, xv.shape))
        new.append(Op("TPCopy", [v.x], [copies[v.x]], {"group": list(plan.group)}, **{**kw, "origin": v.x}))
    ins = [copies[v.x], *v.inputs[1:]]
    return [*new, Op(vocab_parallel.LOSS_OP, ins, [v.out], dict(v.attrs), **kw)]


def rewrite_constants(q: Program, op: Op, constants: dict[int, list], attrs: dict) -> None:
    """Give `op` this rank's shape constants (new constant vars) and attrs (a split rule's result)."""
    for k, value in constants.items():
        src = op.inputs[k]
        name = names.fresh(names.tp_local(src), q.vars)
        v = q.vars[src]
        t = torch.tensor(value, dtype=q.values[src].dtype).reshape(q.values[src].shape)
        q.add_var(Var(name, v.dtype, v.shape, kind="constant"), t)
        op.inputs[k] = name
    op.attrs.update(attrs)


def drop_unread_constants(p: Program, q: Program) -> None:
    """Drop the constants of `p` that rewritten `q` no longer reads (each reshape had its own)."""
    read = {x for op in q.ops for x in op.inputs if x}
    was_read = p.consumers()
    for name in list(q.vars):
        if q.vars[name].kind == "constant" and name not in read and name in was_read:
            del q.vars[name]
            q.values.pop(name, None)

"""Tensor-parallel split propagation: one small rule per op type (passes/tensor_parallel.py walks
the program once and asks this table; nothing else knows how an op carries a split).

A split value is held by each model-parallel rank as a slice along one axis. `Shard` says
which: the full value's axis `axis` is made of `blocks` (their full sizes, in order) and a rank
holds the r-th 1/mp of every block, concatenated. One block is Megatron's plain column split;
several are a fused projection (GPT-2's c_attn [3H, H]: q, k and v blocks, so each rank holds
its own heads of each).

A rule gets a `ShardArgs` (the op, its inputs' shards, full shapes, constants) and returns a
`ShardResult` (its outputs' shards and the constants/attrs to rewrite for the rank's slice), or
raises `ShardRefused` (the split cannot pass: the pass names the op's printed line) or
`ShardNotImplemented` (a known gap the message names).

Random ops (Dropout, attention with dropout) pass a split through as elementwise ops do, and say
so in `ShardResult.draws`: the pass then makes them draw from this rank's model-parallel stream
(MP-aware RNG, metaopt/ops/rng_streams.py), so each rank drops its slice with its own mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metaopt.ops import registry


class ShardRefused(ValueError):
    """The split cannot propagate through this op (the message says why)."""


class ShardNotImplemented(NotImplementedError):
    """The split could propagate, but metaopt does not do it yet (the message says what is missing)."""


@dataclass(frozen=True)
class Shard:
    axis: int  # non-negative, of the full value's rank
    blocks: tuple[int, ...]  # full sizes of the blocks along `axis`; a rank holds 1/mp of each

    def local(self, mp: int) -> int:
        """The rank's size along `axis`."""
        return sum(b // mp for b in self.blocks)

    def local_shape(self, shape: tuple, mp: int) -> tuple:
        return tuple(self.local(mp) if i == self.axis else d for i, d in enumerate(shape))


@dataclass(frozen=True)
class ShardArgs:
    op: Any
    shards: list[Shard | None]  # per input: its split, None when replicated (or omitted)
    shapes: list[tuple | None]  # per input: its full shape
    out_shapes: list[tuple | None]  # per output: its full shape
    mp: int
    constant: Callable[[str], Any]  # a constant input's value as a list (None: not a constant)


@dataclass
class ShardResult:
    outputs: list[Shard | None]
    constants: dict[int, list] = field(default_factory=dict)  # input index -> the rank's value
    attrs: dict[str, Any] = field(default_factory=dict)  # attrs to set for the rank's slice
    note: str = ""  # what was rewritten, for the plan
    # The op draws random numbers from a split value (dropout with p > 0 in training): the pass
    # gives it this rank's model-parallel RNG stream (rng_streams.model_parallel_attrs).
    draws: bool = False


@dataclass(frozen=True)
class ShardRule:
    propagate: Callable[[ShardArgs], ShardResult]
    # The block sizes a column-parallel producer should use when this op reads its output
    # (Split of a fused QKV: one block per piece), given (op, full input shape, constant lookup as
    # in ShardArgs); None: no say.
    blocks_hint: Callable[[Any, tuple, Callable[[str], Any]], tuple[int, ...] | None] | None = None
    # Segment parallel: the op runs on whole sequences over a split of the heads, its split inputs
    # exchanged (all-to-all) before it and its output back after it (attention; token rows only).
    exchange: bool = False
    # Segment parallel: the op is a loss over tokens whose labels are input `labels`: summed or
    # averaged over the local tokens, the pass sums it over the group (token rows only; None: not one)
    labels: int | None = None


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _only_input_0(a: ShardArgs) -> Shard:
    if any(s is not None for s in a.shards[1:]):
        raise ShardRefused("only its first input may be split")
    return a.shards[0]


def _same(a: ShardArgs) -> ShardResult:
    """Elementwise on one value (Gelu, Relu, Identity, Cast ...): the output is split as the input."""
    s = _only_input_0(a)
    return ShardResult([s if o else None for o in a.op.outputs])


def _dropout(a: ShardArgs) -> ShardResult:
    """Elementwise, and random unless its ratio is a constant 0 or it is a constant eval-mode
    dropout (a ratio or mode computed at run time counts as drawing)."""
    ratio = a.constant(a.op.inputs[1]) if len(a.op.inputs) > 1 and a.op.inputs[1] else [0.5]
    train = a.constant(a.op.inputs[2]) if len(a.op.inputs) > 2 and a.op.inputs[2] else [False]
    res = _same(a)
    res.draws = ratio is None or train is None or (float(ratio[0]) > 0 and bool(train[0]))
    return res


def _elementwise(a: ShardArgs) -> ShardResult:
    """Add/Sub/Mul/Div: every split input split alike; a replicated one must not reach the
    split axis (a scalar, or broadcast along it), else each rank would read the whole of it."""
    rank = len(a.out_shapes[0] or ())
    split = None
    for s, shape in zip(a.shards, a.shapes):
        n = len(shape or ())
        if s is not None:
            here = Shard(s.axis + rank - n, s.blocks)
            if split is not None and here != split:
                raise ShardRefused(f"its inputs are split differently ({split} and {here})")
            split = here
    for s, shape in zip(a.shards, a.shapes):
        if s is None and shape is not None:
            at = split.axis - (rank - len(shape))
            if at >= 0 and shape[at] != 1:
                raise ShardRefused(
                    f"a replicated input of shape {list(shape)} spans the split axis {split.axis}"
                )
    return ShardResult([split])


def _transpose(a: ShardArgs) -> ShardResult:
    s = _only_input_0(a)
    rank = len(a.shapes[0])
    perm = a.op.attrs.get("perm") or list(range(rank - 1, -1, -1))
    return ShardResult([Shard(list(perm).index(s.axis), s.blocks)])


def _split_sizes(
    op: Any, shape: tuple, constant: Callable[[str], Any] | None
) -> tuple[int, list[int] | None, str]:
    """(axis, full sizes or None, where the sizes come from: "input", "attr" or "equal")."""
    axis = _axis(op.attrs.get("axis", 0), len(shape))
    if len(op.inputs) > 1 and op.inputs[1]:
        value = constant(op.inputs[1]) if constant else None
        return axis, (None if value is None else [int(v) for v in value]), "input"
    if op.attrs.get("split"):
        return axis, [int(v) for v in op.attrs["split"]], "attr"
    n, parts = shape[axis], len(op.outputs)
    if not isinstance(n, int) or n % parts:
        return axis, None, "equal"
    return axis, [n // parts] * parts, "equal"


def _split(a: ShardArgs) -> ShardResult:
    s = _only_input_0(a)
    axis, sizes, source = _split_sizes(a.op, a.shapes[0], a.constant)
    if axis != s.axis:  # pieces along another axis: each is split as the whole
        return ShardResult([s] * len(a.op.outputs))
    if sizes is None:
        raise ShardRefused("its split sizes are not constant")
    if tuple(sizes) != s.blocks:
        raise ShardRefused(
            f"it splits axis {axis} into {sizes}, but the value is split per rank in blocks {list(s.blocks)} "
            "(a piece would straddle two ranks)"
        )
    local = [n // a.mp for n in sizes]
    res = ShardResult([Shard(axis, (n,)) for n in sizes], note=f"sizes {sizes} -> {local}")
    if source == "input":
        res.constants[1] = local
    elif source == "attr":
        res.attrs["split"] = local
    return res


def _split_hint(op: Any, shape: tuple, constant: Callable[[str], Any]) -> tuple[int, ...] | None:
    axis, sizes, _ = _split_sizes(op, shape, constant)
    return tuple(sizes) if sizes and axis == len(shape) - 1 else None


def _prod(dims: tuple) -> int | None:
    return math.prod(dims) if all(isinstance(d, int) for d in dims) else None


def _reshape(a: ShardArgs) -> ShardResult:
    """A reshape that splits the split axis into (heads, size) or merges (heads, size) back:
    the split axis must be the outermost of its group on both sides, so a rank's contiguous
    slice stays contiguous; the shape constant's count there (heads) is divided by mp."""
    s = _only_input_0(a)
    src, dst = tuple(a.shapes[0]), tuple(a.out_shapes[0] or ())
    ax = s.axis
    if src and dst and ax == len(src) - 1 and src[-1] == dst[-1]:
        return _regroup_leading(a, s, dst)
    if len(s.blocks) != 1:
        raise ShardRefused(f"it reshapes a value split in {len(s.blocks)} blocks (reshape after the Split)")
    if src[:ax] != dst[:ax]:
        raise ShardRefused(f"it changes the dims before the split axis {ax} ({list(src)} -> {list(dst)})")
    group = _group(src[ax:], dst[ax:])
    if group is None:
        raise ShardRefused(
            f"the split axis {ax} does not map to one group of dims ({list(src)} -> {list(dst)})"
        )
    if not isinstance(dst[ax], int) or dst[ax] % a.mp:
        raise ShardRefused(f"output dim {ax} ({dst[ax]}) is not divisible by mp_degree {a.mp}")
    target = a.constant(a.op.inputs[1])
    if target is None:
        raise ShardRefused("its target shape is computed at run time (not a constant)")
    target = [int(v) for v in target]
    local = list(target)
    if local[ax] > 0:  # -1 (inferred) and 0 (copied from the input's local dim) stay right
        local[ax] //= a.mp
    return ShardResult([Shard(ax, (dst[ax],))], constants={1: local}, note=f"shape {target} -> {local}")


def _regroup_leading(a: ShardArgs, s: Shard, dst: tuple) -> ShardResult:
    """A reshape of the leading dims only, the split last (feature) dim kept whole (the Reshapes
    around a 2-D Gemm: [B, S, F] <-> [B*S, F]): every block stays, the target's last entry is the
    rank's share of the features."""
    target = a.constant(a.op.inputs[1])
    if target is None:
        raise ShardRefused("its target shape is computed at run time (not a constant)")
    target = [int(v) for v in target]
    local = list(target)
    if local[-1] > 0:  # -1 (inferred) and 0 (copied from the input's local dim) stay right
        local[-1] = s.local(a.mp)
    out = Shard(len(dst) - 1, s.blocks)
    return ShardResult([out], constants={1: local}, note=f"shape {target} -> {local}")


def _group(src: tuple, dst: tuple) -> tuple[int, int] | None:
    """(ni, no): the first ni dims of `src` hold exactly the first no dims of `dst`, the rest equal."""
    for ni in range(1, len(src) + 1):
        for no in range(1, len(dst) + 1):
            a, b = _prod(src[:ni]), _prod(dst[:no])
            if a is not None and a == b and src[ni:] == dst[no:]:
                return ni, no
    return None


def _sdpa(a: ShardArgs) -> ShardResult:
    """Attention over split heads: q, k, v split alike on the heads axis (rank - 3); the mask
    replicated and broadcast over heads; each rank attends with its own heads only."""
    q, k, v = a.shards[:3]
    if q is None or q != k or q != v:
        raise ShardRefused(f"q, k and v are not split alike ({q}, {k}, {v})")
    rank = len(a.shapes[0])
    if q.axis != rank - 3:
        raise ShardRefused(f"q is split on axis {q.axis}, not the heads axis {rank - 3}")
    if len(a.shards) > 3 and a.shards[3] is not None:
        raise ShardRefused("its mask is split")
    mask = a.shapes[3] if len(a.shapes) > 3 else None
    at = q.axis - (rank - len(mask)) if mask is not None else -1
    if mask is not None and at >= 0 and mask[at] != 1:
        raise ShardRefused(f"its mask of shape {list(mask)} differs per head (heads of other ranks)")
    outs = [
        Shard(q.axis, q.blocks) if o and len(a.out_shapes[k] or ()) > q.axis else None
        for k, o in enumerate(a.op.outputs)
    ]
    # Dropout on the probabilities of this rank's heads: its own mask (model-parallel stream).
    return ShardResult(outs, draws=float(a.op.attrs.get("dropout_p", 0.0)) > 0)


def _slice(a: ShardArgs) -> ShardResult:
    """A Slice that takes the split axis whole (``x[:, :, None]`` of repeat_kv, x[..., :h] of a
    rotation on another axis): the output is split as the input."""
    s = _only_input_0(a)
    rank = len(a.shapes[0])
    starts, ends = (a.constant(x) if x else None for x in a.op.inputs[1:3])
    axes = a.constant(a.op.inputs[3]) if len(a.op.inputs) > 3 and a.op.inputs[3] else None
    if starts is None or ends is None or (len(a.op.inputs) > 3 and a.op.inputs[3] and axes is None):
        raise ShardRefused("its bounds are computed at run time (not constants)")
    axes = [int(x) % rank for x in axes] if axes is not None else list(range(len(starts)))
    for ax, start, end in zip(axes, starts, ends, strict=True):
        if ax == s.axis and (int(start) != 0 or int(end) < a.shapes[0][ax]):
            raise ShardRefused(f"it slices the split axis {ax} ([{int(start)}:{int(end)}])")
    return ShardResult([s])


def _unsqueeze(a: ShardArgs) -> ShardResult:
    """The split axis moves past the inserted ones before it."""
    s = _only_input_0(a)
    axes = a.constant(a.op.inputs[1]) if len(a.op.inputs) > 1 and a.op.inputs[1] else a.op.attrs.get("axes")
    if axes is None:
        raise ShardRefused("its axes are computed at run time (not a constant)")
    rank = len(a.out_shapes[0] or ())
    inserted = {int(x) % rank for x in axes}
    kept = [i for i in range(rank) if i not in inserted]  # output positions of the input's dims
    return ShardResult([Shard(kept[s.axis], s.blocks)])


def _expand(a: ShardArgs) -> ShardResult:
    """An Expand that does not broadcast along the split axis (repeat_kv repeats each KV head
    within the heads of one rank): the target's count there is divided by mp."""
    s = _only_input_0(a)
    target = a.constant(a.op.inputs[1])
    if target is None:
        raise ShardRefused("its target shape is computed at run time (not a constant)")
    target = [int(v) for v in target]
    src, dst = tuple(a.shapes[0]), tuple(a.out_shapes[0] or ())
    ax = s.axis + len(dst) - len(src)
    if dst[ax] != src[s.axis]:
        raise ShardRefused(f"it broadcasts the split axis {s.axis} ({src[s.axis]} -> {dst[ax]})")
    local = list(target)
    at = ax - (len(dst) - len(target))
    if at >= 0 and local[at] > 1:  # 1 keeps the input's (local) dim
        local[at] //= a.mp
    return ShardResult([Shard(ax, s.blocks)], constants={1: local}, note=f"shape {target} -> {local}")


def _rotary(a: ShardArgs) -> ShardResult:
    """Rotary / RotaryGrad (x or its grad, cos, sin): elementwise over every dim but the last,
    whose halves the rotation mixes; cos and sin replicated (broadcast over heads), or split as x
    along the tokens."""
    s = a.shards[0]
    if s is None:
        raise ShardRefused("x is not split (cos and sin split alone)")
    if s.axis == len(a.shapes[0]) - 1:
        raise ShardRefused("it is split on the rotated (last) axis, whose halves it mixes")
    return _elementwise(a)  # cos and sin: replicated, or split alike (segment parallel's chunks)


def _norm(a: ShardArgs) -> ShardResult:
    """LayerNormalization / RMSNormalization (normalizing the dims from their `axis` on) and
    RMSNorm (the last dim): a split on an axis before the normalized ones passes (each token is
    normalized on its own: sequence parallel's norms); scale and bias replicated. Every output
    (the saved mean and inverse std too) is split as the input."""
    s = _only_input_0(a)
    rank = len(a.shapes[0])
    start = rank - 1 if a.op.type == "RMSNorm" else _axis(a.op.attrs.get("axis", -1), rank)
    if s.axis >= start:
        raise ShardRefused(f"it normalizes over the split axis {s.axis}")
    outs = [Shard(s.axis, s.blocks) if o and len(a.out_shapes[k] or ()) > s.axis else None
            for k, o in enumerate(a.op.outputs)]  # fmt: skip
    return ShardResult(outs)


_UNARY = (
    "Identity", "Gelu", "Relu", "Tanh", "Sigmoid", "Erf", "Neg", "Cast", "Sqrt", "Exp", "Silu", "QuickGelu",
)  # fmt: skip
_SAME = ShardRule(_same)
_ELEMENTWISE = ShardRule(_elementwise)

_RULES: dict[str, ShardRule] = {
    **{t: _SAME for t in _UNARY},
    **{t: _ELEMENTWISE for t in ("Add", "Sub", "Mul", "Div", "SiluMul")},
    "Dropout": ShardRule(_dropout),
    "Transpose": ShardRule(_transpose),
    "Split": ShardRule(_split, blocks_hint=_split_hint),
    "Reshape": ShardRule(_reshape),
    "ScaledDotProductAttention": ShardRule(_sdpa),
    "Rotary": ShardRule(_rotary),
    "Slice": ShardRule(_slice),
    "Unsqueeze": ShardRule(_unsqueeze),
    "Expand": ShardRule(_expand),
    "RotaryGrad": ShardRule(_rotary),
    **{t: ShardRule(_norm) for t in ("LayerNormalization", "RMSNormalization", "RMSNorm")},
}


for _type, _rule in _RULES.items():  # each rule goes into its op's row (`OpDef.shard`)
    registry.extend(_type, shard=_rule)
# sequence parallel's part of a few ops (`OpDef.sequence`, passes/sequence_parallel.py)
_SEQUENCE = {
    "TPReduce": "reduce", "TPCopy": "copy", "Add": "bias", "Dropout": "sliced_draw", "SPGather": "gather",
    "ScaledDotProductAttention": "sliced_draw", "Cast": "remake",
}  # fmt: skip
for _type, _kind in _SEQUENCE.items():
    registry.extend(_type, sequence=_kind)
del _type, _rule, _kind


# --- segment parallel's token-wise rows (passes/segment_parallel.py) --------------------------
# A value split along its tokens (the sequence, or rows merging [batch, seq]) passes through ops
# that treat each token on its own. `token_rule` asks these rows first, then the rows above: they
# are asked about token splits only. Tensor parallel splits features, where a Linear is a column
# or row layer the user names; sequence parallel's regions end at the column layers (gathering
# their inputs costs less than the logits an LM head's region would hold).


def _rows(shape: tuple, s: Shard) -> bool:
    """Whether `s` splits the rows merging [batch, seq] (its axis holds several sequences)."""
    return shape[s.axis] != sum(s.blocks)


def _tokens_linear(a: ShardArgs) -> ShardResult:
    """Linear / Gemm / MatMul of a split x by a replicated weight: each token's row is multiplied
    on its own, so a split of any axis of x but the contracted last one passes."""
    s = a.shards[0]
    if s is None or any(x is not None for x in a.shards[1:]):
        raise ShardRefused("only its input x may be split (its weight and bias are replicated)")
    rank = len(a.shapes[0])
    if s.axis == rank - 1:
        raise ShardRefused("x is split on the contracted (feature) axis")
    if a.op.type == "Gemm" and a.op.attrs.get("transA"):
        raise ShardRefused("it transposes x (transA)")
    if a.op.type == "MatMul" and len(a.shapes[1] or ()) != 2:
        raise ShardRefused("its second input is not a 2-D weight")
    out = len(a.out_shapes[0] or ())
    return ShardResult([Shard(s.axis + out - rank, s.blocks)])


def _tokens_gather(a: ShardArgs) -> ShardResult:
    """An embedding lookup (Gather on axis 0 of a replicated table): each index looks up its own row."""
    if a.shards[0] is not None:
        raise ShardRefused("its table is split")
    s = a.shards[1]
    if s is None:
        raise ShardRefused("its indices are not split")
    if _axis(a.op.attrs.get("axis", 0), len(a.shapes[0])) != 0:
        raise ShardRefused("it gathers along an axis other than the table's rows")
    return ShardResult([Shard(s.axis, s.blocks)])


def _tokens_reshape(a: ShardArgs) -> ShardResult:
    """[batch, seq, ...] -> [batch * seq, ...] with the sequence split (each rank's rows: the chunk
    of every sequence, `_rows`), and back; any other reshape as tensor parallel's rule says."""
    s = _only_input_0(a)
    src, dst = tuple(a.shapes[0]), tuple(a.out_shapes[0] or ())
    target = a.constant(a.op.inputs[1]) if len(a.op.inputs) > 1 else None
    (n,) = s.blocks if len(s.blocks) == 1 else (None,)
    merge = s.axis == 1 and len(dst) == len(src) - 1 and dst[1:] == src[2:]
    if n is not None and not _rows(src, s) and merge:
        out = Shard(0, s.blocks)  # merged: batch rows of `n` tokens each, every one split alike
        return _tokens_target(a, target, out, 0)
    unmerge = len(dst) == len(src) + 1 and dst[2:] == src[1:] and dst[1] == n
    if n is not None and _rows(src, s) and s.axis == 0 and unmerge:
        return _tokens_target(a, target, Shard(1, s.blocks), 1)
    if _rows(src, s):
        raise ShardRefused(f"it reshapes rows merging [batch, seq] otherwise ({list(src)} -> {list(dst)})")
    k = len(dst) - (len(src) - s.axis)
    if n is not None and k >= 0 and src[s.axis :] == dst[k:] and src[: s.axis] != dst[:k]:
        # the dims before the split axis regroup, it and the rest kept: each of them holds the chunk
        return _tokens_target(a, target, Shard(k, s.blocks), k)
    return _reshape(a)


def _tokens_target(a: ShardArgs, target: list | None, out: Shard, at: int) -> ShardResult:
    """The reshape's output split as `out` (on output axis `at`); its target's count there, where
    given, becomes the rank's: the same number of sequences, each its chunk."""
    if target is None:
        raise ShardRefused("its target shape is computed at run time (not a constant)")
    target = [int(v) for v in target]
    local = list(target)
    at = at - (len(a.out_shapes[0] or ()) - len(target))
    if at >= 0 and local[at] > 0:  # -1 (inferred) and 0 (copied from the input) stay right
        n = sum(out.blocks)
        if local[at] % n:
            raise ShardRefused(f"its target's count {local[at]} on the split axis is not whole sequences")
        local[at] = local[at] // n * out.local(a.mp)
    note = f"shape {target} -> {local}"
    return ShardResult([out], constants={1: local} if local != target else {}, note=note)


def _tokens_attention(a: ShardArgs) -> ShardResult:
    """Attention on the local sequence (Ulysses): the pass exchanges q, k and v to whole sequences
    over 1/degree of the heads before it and the output back after it (`ShardRule.exchange`); here,
    whether that can be done: q, k, v split alike on the sequence (rank - 2), heads divisible by
    the degree, a mask replicated and broadcast over heads."""
    q, k, v = a.shards[:3]
    rank = len(a.shapes[0])
    if q is None or q != k or q != v or q.axis != rank - 2:
        raise ShardRefused(f"q, k and v are not split alike on the sequence ({q}, {k}, {v})")
    heads = [sh[rank - 3] for sh in a.shapes[:3]]
    if any(not isinstance(h, int) or h % a.mp for h in heads):
        raise ShardRefused(f"its heads {heads} are not divisible by {a.mp}")
    if len(a.shards) > 3 and a.shards[3] is not None:
        raise ShardRefused("its mask is split")
    mask = a.shapes[3] if len(a.shapes) > 3 else None
    at = (rank - 3) - (rank - len(mask)) if mask is not None else -1
    if mask is not None and at >= 0 and mask[at] != 1:
        raise ShardRefused(f"its mask of shape {list(mask)} differs per head")
    outs = [q if k == 0 else None for k in range(len(a.op.outputs))]
    return ShardResult(outs, draws=float(a.op.attrs.get("dropout_p", 0.0)) > 0)


def _tokens_loss(a: ShardArgs) -> ShardResult:
    """A cross-entropy over split tokens (logits and labels split alike on the rows): per token
    (reduction none) the output is split as the labels; summed or averaged, the pass sums it over
    the group (passes/segment_parallel.py's loss point)."""
    x, y = a.shards[:2]
    if x is None or y is None or x.axis != 0 or y.axis != 0 or x.blocks != y.blocks:
        raise ShardRefused(f"its logits and labels are not split alike on the rows ({x}, {y})")
    if len(a.op.inputs) > 2 and a.op.inputs[2] and a.op.attrs.get("reduction", "mean") == "mean":
        raise ShardRefused("its mean is weighted by class weights (not a count of the tokens)")
    per_token = a.op.attrs.get("reduction", "mean") == "none"
    # output 1, the log-probabilities, holds a row per token: split as the logits
    return ShardResult([(y if per_token else None) if k == 0 else x for k in range(len(a.op.outputs))])


def _tokens_linear_loss(a: ShardArgs) -> ShardResult:
    """The fused LM head + cross-entropy (x, weight, labels[, bias]): x split on a token axis (the
    tokens x.flatten(0, -2) makes rows of) and the labels' rows split alike; the weight replicated.
    Summed or averaged: the pass sums it over the group (as `_tokens_loss`)."""
    x, w, y = a.shards[:3]
    rank = len(a.shapes[0])
    if x is None or y is None or x.axis >= rank - 1 or y.axis != 0 or x.blocks != y.blocks:
        raise ShardRefused(f"its hidden states and labels are not split alike on the tokens ({x}, {y})")
    if w is not None or (len(a.shards) > 3 and a.shards[3] is not None):
        raise ShardRefused("its weight or bias is split")
    return ShardResult([None] * len(a.op.outputs))


_TOKEN_RULES: dict[str, ShardRule] = {
    **{t: ShardRule(_tokens_linear) for t in ("Linear", "Gemm", "MatMul")},
    "Gather": ShardRule(_tokens_gather),
    "Reshape": ShardRule(_tokens_reshape),
    "ScaledDotProductAttention": ShardRule(_tokens_attention, exchange=True),
    "SoftmaxCrossEntropyLoss": ShardRule(_tokens_loss, labels=1),
    "LinearCrossEntropy": ShardRule(_tokens_linear_loss, labels=2),
}
for _type, _rule in _TOKEN_RULES.items():
    registry.extend(_type, tokens=_rule)

del _type, _rule


def sequence_kind(op: Any) -> str | None:
    """The op's part in sequence parallel (its row's `sequence`); None: none."""
    row = registry.get(op.type)
    return None if row is None else row.sequence


def is_view(op: Any) -> bool:
    """Whether the op only views its input (Reshape, Identity ...): its grad passes partial sums on
    as partial sums."""
    row = registry.get(op.type)
    return row is not None and row.view


def rule(op_type: str) -> ShardRule | None:
    """The split rule of `op_type` (its row's `shard`); None: a split value cannot pass through it."""
    row = registry.get(op_type)
    return None if row is None else row.shard


def linear_parts(op: Any) -> tuple[str, str, str] | None:
    """(x, weight, bias or "") of a linear layer; None for any other op: only these are column- or
    row-parallel layers. A linear layer is metaopt's `Linear` (torch's nn.Linear on a >2-D input,
    weight [out, in]) or a plain ``Gemm`` (alpha = beta = 1, A not transposed, a 1-D bias or none):
    torch's nn.Linear on a 2-D input (transB=1, weight [out, in]) and Hugging Face's Conv1D
    (GPT-2: transB=0, weight [in, out]). `weight_out_axis` says which axis of the weight is out."""
    if op.type == "Linear":
        x, w, *rest = op.inputs
        return x, w, (rest[0] if rest else "")
    if op.type == "Gemm":
        a = op.attrs
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
            return None
        x, w, *rest = op.inputs
        return x, w, (rest[0] if rest else "")
    return None


def weight_out_axis(op: Any) -> int:
    """The axis of a linear layer's weight (`linear_parts`) along its output features."""
    return 1 if op.type == "Gemm" and not op.attrs.get("transB", 0) else 0


def keeps_features(op: Any, in_shape: tuple | None, out_shape: tuple | None) -> bool:
    """Whether `op` only regroups the leading dims of a value, keeping its last (feature) dim as is
    (the Reshapes around a 2-D Gemm: [B, S, F] <-> [B*S, F]): a column layer looks through it for
    the Split that cuts its features into blocks."""
    return (
        op.type == "Reshape"
        and in_shape is not None
        and out_shape is not None
        and len(in_shape) >= 1
        and len(out_shape) >= 1
        and in_shape[-1] == out_shape[-1]
        and isinstance(in_shape[-1], int)
    )


def token_rule(op_type: str) -> ShardRule | None:
    """How a value split along its tokens passes through `op_type` (segment parallel): its row's
    `tokens` rule, else its `shard` rule; None: a token split cannot pass through it."""
    row = registry.get(op_type)
    if row is None:
        return None
    return row.tokens if row.tokens is not None else row.shard

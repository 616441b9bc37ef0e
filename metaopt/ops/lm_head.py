"""The language-model head + softmax cross-entropy pattern, as torch's exporter writes it (op
knowledge for passes/fuse_linear_cross_entropy.py, which documents the chain; the pass itself
switches on no op type).

`match` walks back from a ``SoftmaxCrossEntropyLoss``: reshapes to [N, V], row slices and
identities, an optional per-class bias Add, then the head (MatMul on a transposed or [H, V]
weight, Linear, Gemm); every intermediate must have that one reader. `forwarded_input` says which
input a chain op passes on, for the rewrite that recomputes the chain from the hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

from metaopt.ir import Op, Program, roles

LOSS_OP = "SoftmaxCrossEntropyLoss"


class NotFused(Exception):
    """The loss does not match the pattern; the message says why (it goes into the plan)."""


@dataclass(frozen=True)
class HeadMatch:
    loss: str  # the loss op's output
    x: str  # the hidden states the head reads
    weight: str
    bias: str  # "" when none
    labels: str
    trans_b: int  # 1: weight is [V, H] (F.linear's layout); 0: [H, V]
    classes: int
    absorbed: tuple[int, ...]  # op indices dropped (head, transpose, bias add, identities, reshapes)
    chain: tuple[int, ...]  # of those, the ones passing the logits on (bias add, identities, reshapes)
    moved: tuple[int, ...]  # Slice ops re-applied to the hidden states
    anchor: int  # the loss op's index


def is_loss(op: Op) -> bool:
    """Is `op` the softmax cross-entropy this pattern ends in?"""
    return op.type == LOSS_OP


def forwarded_input(op: Op, bias: str) -> str:
    """The input a chain op (Identity, Reshape, the bias Add) passes the logits on from."""
    return next(x for x in op.inputs if x != bias) if op.type == "Add" else op.inputs[0]


def match(p: Program, i: int, producers, consumers, kept: set[str], min_classes: int) -> HeadMatch:
    """The head + loss around the loss op `i` of `p`, or NotFused(reason) (module doc)."""
    loss_op = p.ops[i]
    if len(loss_op.inputs) > 2 and loss_op.inputs[2]:
        raise NotFused("class weights are not fused")
    reduction = loss_op.attrs.get("reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise NotFused(f"reduction={reduction!r} (only 'mean' and 'sum' are fused)")
    if any(consumers.get(o) or o in kept for o in loss_op.outputs[1:] if o):
        raise NotFused("its log-probabilities output is read")
    scores, labels = loss_op.inputs[:2]
    s_shape = p.vars[scores].shape
    if s_shape is None or len(s_shape) != 2:
        raise NotFused(f"scores {scores!r} of shape {s_shape}: the class axis is not the last of 2")
    classes = s_shape[1]
    if not isinstance(classes, int):
        raise NotFused(f"the class count {classes!r} is not static")
    if classes < min_classes:
        raise NotFused(f"{classes} classes < min_classes={min_classes} (a classifier: nothing to save)")

    def only_reader(name: str, reader: int) -> None:
        if name in kept:
            raise NotFused(f"{name!r} is a program output or fetched: the logits must stay (not fused)")
        readers = consumers.get(name, [])
        if readers != [reader]:
            others = [f"{p.ops[j].type} (op {j})" for j in readers if j != reader]
            raise NotFused(f"{name!r} has another reader, {', '.join(others)}: the logits must stay")

    # Walk back from the scores: reshapes (last dim V), then row slices / identities, then an
    # optional bias Add, then the head.
    absorbed: list[int] = []
    chain: list[int] = []  # the absorbed ops that pass the logits on (not the head)
    moved: list[int] = []
    cur, reader = scores, i
    phase = "flat"
    bias = ""
    while True:
        only_reader(cur, reader)
        j = producers.get(cur)
        if j is None:
            raise NotFused(f"scores {scores!r} are not computed from a linear head ({cur!r} is fed)")
        op = p.ops[j]
        if not roles.is_forward(op.role):
            raise NotFused(f"{cur!r} is made by a {op.role} op")
        src = op.inputs[0] if op.inputs else ""
        shape = p.vars[src].shape if src in p.vars else None
        if op.type == "Reshape" and phase == "flat" and shape and shape[-1] == classes:
            absorbed.append(j)
            chain.append(j)
        elif op.type == "Identity":
            absorbed.append(j)
            chain.append(j)
        elif op.type == "Slice" and phase in ("flat", "rows") and shape and _row_slice(p, op, len(shape)):
            phase = "rows"
            moved.append(j)
        elif op.type == "Add" and phase != "bias" and not bias:
            other = [x for x in op.inputs if x != cur]
            if len(other) != 1 or not _per_class(p.vars[other[0]].shape, classes):
                raise NotFused(f"the logits pass through {op.type} (op {j}), not a per-class bias")
            bias, phase = other[0], "bias"
            src = cur = next(x for x in op.inputs if x != other[0])
            absorbed.append(j)
            chain.append(j)
            reader = j
            continue
        else:
            head = _head(p, j, producers, consumers, classes)
            if head is None:
                raise NotFused(f"the logits come from {op.type} (op {j}), not a linear head this pass knows")
            x, weight, head_bias, trans_b, extra = head
            if head_bias and bias:
                raise NotFused("two biases (the head's and an Add's)")
            absorbed += [j, *extra]
            bias = bias or head_bias
            break
        cur, reader = src, j
    xv, wv = p.vars[x], p.vars[weight]
    if xv.shape is None or len(xv.shape) < 2 or xv.dtype != wv.dtype:
        raise NotFused(f"hidden states {x!r} {xv.shape} {xv.dtype} and weight {wv.dtype} do not fit")
    return HeadMatch(
        loss=loss_op.outputs[0],
        x=x,
        weight=weight,
        bias=bias,
        labels=labels,
        trans_b=trans_b,
        classes=classes,
        absorbed=tuple(sorted(absorbed)),
        chain=tuple(sorted(chain)),
        moved=tuple(sorted(moved)),
        anchor=i,
    )


def _const(p: Program, name: str) -> list[int] | None:
    if not name:
        return None
    v = p.vars.get(name)
    if v is None or v.kind != "constant" or name not in p.values:
        return None
    return [int(t) for t in p.values[name].reshape(-1).tolist()]


def _row_slice(p: Program, op: Op, rank: int) -> bool:
    """A Slice whose (constant) axes leave the last axis, the classes, whole."""
    starts = _const(p, op.inputs[1]) if len(op.inputs) > 1 else None
    if starts is None:
        return False
    axes = _const(p, op.inputs[3]) if len(op.inputs) > 3 and op.inputs[3] else list(range(len(starts)))
    return axes is not None and all(a % rank != rank - 1 for a in axes)


def _per_class(shape, classes: int) -> bool:
    return shape is not None and len(shape) >= 1 and shape[-1] == classes and all(d == 1 for d in shape[:-1])


def _head(p: Program, j: int, producers, consumers, classes: int):
    """(x, weight, bias, transB, extra absorbed op indices) of a linear head op, else None."""
    op = p.ops[j]
    if op.type == "MatMul" and len(op.inputs) == 2:
        x, b = op.inputs
        t = producers.get(b)
        top = p.ops[t] if t is not None else None
        if top is not None and top.type == "Transpose" and top.attrs.get("perm") == [1, 0]:
            w = top.inputs[0]
            if _is_2d(p, w) and p.vars[w].shape[0] == classes:
                # the transposed view is dropped when the head was its only reader
                return x, w, "", 1, [t] if consumers.get(b) == [j] and b not in p.outputs else []
        if _is_2d(p, b) and p.vars[b].shape[1] == classes:
            return x, b, "", 0, []
        return None
    if op.type == "Linear":
        x, w = op.inputs[:2]
        bias = op.inputs[2] if len(op.inputs) > 2 else ""
        if (
            _is_2d(p, w)
            and p.vars[w].shape[0] == classes
            and (not bias or _per_class(p.vars[bias].shape, classes))
        ):
            return x, w, bias, 1, []
        return None
    if op.type == "Gemm":
        a = op.attrs
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
            return None
        x, w = op.inputs[:2]
        bias = op.inputs[2] if len(op.inputs) > 2 else ""
        tb = int(a.get("transB", 0))
        if not _is_2d(p, w) or p.vars[w].shape[0 if tb else 1] != classes:
            return None
        if bias and not _per_class(p.vars[bias].shape, classes):
            return None
        return x, w, bias, tb, []
    return None


def _is_2d(p: Program, name: str) -> bool:
    v = p.vars.get(name)
    return v is not None and v.shape is not None and len(v.shape) == 2

"""Fuse an LM head and its softmax cross-entropy into one chunked op: `LinearCrossEntropy`.

A language model's loss is ``F.cross_entropy(lm_head(h).flatten(0, -2), labels)``: a
``tokens x vocab`` logits tensor (``batch x 512 x 30522`` for BERT-Large), its log-softmax saved
for the backward, its gradient of the same size, and under AMP a float32 copy of it (the loss is
black-listed). For a large vocabulary these are the largest tensors of a training step. The
fused op (ops/kernels/loss.py) computes the loss `chunk_size` tokens at a time and its gradient
chunk by chunk with the logits recomputed, so at most one chunk of logits is alive; it is exact
(the same matmul per token, float32 logsumexp as the unfused Cast + loss; float64 metric).

What torch's exporter writes, and what this pass matches (walking back from each
``SoftmaxCrossEntropyLoss``; every intermediate must have that one reader)::

    head   MatMul(h, Transpose(W, perm=[1, 0]))   nn.Linear without bias (GPT-2, Llama, OPT, T5)
           MatMul(h, W)                           a [H, V] weight
           Linear(h, W, b)                        nn.Linear with bias (metaopt's fused import; BERT)
           Gemm(h, W, b, transB, alpha=beta=1)    a 2-D head
    bias   Add(logits, b)                         a per-class bias added after (BART's final_logits_bias)
    rows   Slice on any axis but the last, Identity   the causal shift logits[:, :-1]
    flat   Reshape to [N, V]                      the flatten before F.cross_entropy
    loss   SoftmaxCrossEntropyLoss(scores [N, V], labels), reduction mean or sum, no class weights

Row slices act on tokens, not classes, so they are moved onto the hidden states (the same Slice
op, reading ``h``: ``logits[:, :-1] == lm_head(h[:, :-1])``); the loss's labels (and their own
shift) are left as they are. The fused op takes the loss op's place, name, role and scope.

Not fused, with the reason in the plan (``print(plan)``): logits (or anything between the head
and the loss) read by another op or named a program output — a user who fetches the logits keeps
them; fewer classes than `min_classes` (a classifier: nothing to save, one more matmul to pay);
class weights; ``reduction='none'``; scores whose class axis is not the last (rank > 2); a head
or chain this pass does not know. The pass rewrites the forward: it runs before AMP (which casts
the fused op's matmul operands to the low dtype and keeps its loss float32) and before the
backward (whose rule emits one chunked `LinearCrossEntropyGrad`).

Fleet: ``strategy.fuse_linear_cross_entropy`` (default True) runs it as the first step of
``minimize`` (fleet/steps.py); set it to False to keep the unfused ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, roles
from metaopt.ops.kernels.loss import DEFAULT_CHUNK_TOKENS

# Fewer classes than this is a classifier head: its logits are small, chunking buys nothing.
MIN_CLASSES = 1024
# A chunk's float32 logits are at most this many bytes (and one chunk is at most
# DEFAULT_CHUNK_TOKENS tokens): 64 MiB is 334 tokens of GPT-2's 50257 classes.
CHUNK_BYTES = 64 * 2**20


class FuseLinearCrossEntropyError(ValueError):
    pass


@dataclass(frozen=True)
class Fusion:
    """One head + loss fused: the new op and what it replaces."""

    loss: str  # the loss op's output (the fused op's)
    x: str  # the hidden states the head reads
    weight: str
    bias: str  # "" when none
    labels: str
    trans_b: int  # 1: weight is [V, H] (F.linear's layout); 0: [H, V]
    classes: int
    chunk_size: int
    absorbed: tuple[int, ...]  # op indices dropped (head, transpose, bias add, identities, reshapes)
    moved: tuple[int, ...]  # Slice ops re-applied to the hidden states
    anchor: int  # the loss op's index: the fused op takes its place

    def __str__(self) -> str:
        b = f", {self.bias}" if self.bias else ""
        moved = f"; row slices moved onto {self.x!r}: {len(self.moved)}" if self.moved else ""
        return (
            f"fused    {self.loss} = LinearCrossEntropy({self.x}, {self.weight}, {self.labels}{b})  "
            f"{self.classes} classes, chunks of {self.chunk_size} tokens, replaces {len(self.absorbed) + 1} "
            f"ops{moved}"
        )


@dataclass(frozen=True)
class Skipped:
    loss: str  # the loss op's output
    reason: str

    def __str__(self) -> str:
        return f"skipped  {self.loss}: {self.reason}"


@dataclass
class FuseLinearCrossEntropyPlan:
    fused: list[Fusion] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"fuse_linear_cross_entropy: {len(self.fused)} fused, {len(self.skipped)} skipped"
        if not self.fused and not self.skipped:
            head += " (no SoftmaxCrossEntropyLoss in the program)"
        return "\n".join([head, *(f"  {f}" for f in self.fused), *(f"  {s}" for s in self.skipped)])


class _Skip(Exception):
    pass


def plan_fuse_linear_cross_entropy(
    p: Program,
    *,
    min_classes: int = MIN_CLASSES,
    chunk_size: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    fetches: Sequence[str] = (),
) -> FuseLinearCrossEntropyPlan:
    """Which losses of `p` fuse with their head, and why the others do not (module doc).

    `chunk_size`: tokens per chunk (default: as many as keep one chunk's float32 logits within
    `chunk_bytes`, at most DEFAULT_CHUNK_TOKENS); `fetches`: vars the caller will fetch besides
    the program's outputs (kept, so a head whose logits are among them is not fused)."""
    if chunk_size is not None and chunk_size < 1:
        raise FuseLinearCrossEntropyError(f"chunk_size must be >= 1, got {chunk_size}")
    if chunk_bytes < 1:
        raise FuseLinearCrossEntropyError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    late = next((op for op in p.ops if not roles.is_forward(op.role)), None)
    if late is not None:
        raise FuseLinearCrossEntropyError(
            f"fuse_linear_cross_entropy rewrites the forward of program {p.name!r}, but it already has "
            f"a {late.role} op ({late.type}): apply it before append_backward / minimize"
        )
    plan = FuseLinearCrossEntropyPlan()
    producers, consumers = p.producers(), p.consumers()
    kept = {*p.outputs, *fetches, *p.updates.values()} - {p.loss_name}
    for i, op in enumerate(p.ops):
        if op.type != "SoftmaxCrossEntropyLoss":
            continue
        try:
            plan.fused.append(_match(p, i, producers, consumers, kept, min_classes, chunk_size, chunk_bytes))
        except _Skip as e:
            plan.skipped.append(Skipped(op.outputs[0], str(e)))
    return plan


def _match(p, i, producers, consumers, kept, min_classes, chunk_size, chunk_bytes) -> Fusion:
    loss_op = p.ops[i]
    if len(loss_op.inputs) > 2 and loss_op.inputs[2]:
        raise _Skip("class weights are not fused")
    reduction = loss_op.attrs.get("reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise _Skip(f"reduction={reduction!r} (only 'mean' and 'sum' are fused)")
    if any(consumers.get(o) or o in kept for o in loss_op.outputs[1:] if o):
        raise _Skip("its log-probabilities output is read")
    scores, labels = loss_op.inputs[:2]
    s_shape = p.vars[scores].shape
    if s_shape is None or len(s_shape) != 2:
        raise _Skip(f"scores {scores!r} of shape {s_shape}: the class axis is not the last of 2")
    classes = s_shape[1]
    if not isinstance(classes, int):
        raise _Skip(f"the class count {classes!r} is not static")
    if classes < min_classes:
        raise _Skip(f"{classes} classes < min_classes={min_classes} (a classifier: nothing to save)")

    def only_reader(name: str, reader: int) -> None:
        if name in kept:
            raise _Skip(f"{name!r} is a program output or fetched: the logits must stay (not fused)")
        readers = consumers.get(name, [])
        if readers != [reader]:
            others = [f"{p.ops[j].type} (op {j})" for j in readers if j != reader]
            raise _Skip(f"{name!r} has another reader, {', '.join(others)}: the logits must stay")

    # Walk back from the scores: reshapes (last dim V), then row slices / identities, then an
    # optional bias Add, then the head.
    absorbed: list[int] = []
    moved: list[int] = []
    cur, reader = scores, i
    phase = "flat"
    bias = ""
    while True:
        only_reader(cur, reader)
        j = producers.get(cur)
        if j is None:
            raise _Skip(f"scores {scores!r} are not computed from a linear head ({cur!r} is fed)")
        op = p.ops[j]
        if not roles.is_forward(op.role):
            raise _Skip(f"{cur!r} is made by a {op.role} op")
        src = op.inputs[0] if op.inputs else ""
        shape = p.vars[src].shape if src in p.vars else None
        if op.type == "Reshape" and phase == "flat" and shape and shape[-1] == classes:
            absorbed.append(j)
        elif op.type == "Identity":
            absorbed.append(j)
        elif op.type == "Slice" and phase in ("flat", "rows") and shape and _row_slice(p, op, len(shape)):
            phase = "rows"
            moved.append(j)
        elif op.type == "Add" and phase != "bias" and not bias:
            other = [x for x in op.inputs if x != cur]
            if len(other) != 1 or not _per_class(p.vars[other[0]].shape, classes):
                raise _Skip(f"the logits pass through {op.type} (op {j}), not a per-class bias")
            bias, phase = other[0], "bias"
            src = cur = next(x for x in op.inputs if x != other[0])
            absorbed.append(j)
            reader = j
            continue
        else:
            head = _head(p, j, producers, consumers, classes)
            if head is None:
                raise _Skip(f"the logits come from {op.type} (op {j}), not a linear head this pass knows")
            x, weight, head_bias, trans_b, extra = head
            if head_bias and bias:
                raise _Skip("two biases (the head's and an Add's)")
            absorbed += [j, *extra]
            bias = bias or head_bias
            break
        cur, reader = src, j
    xv, wv = p.vars[x], p.vars[weight]
    if xv.shape is None or len(xv.shape) < 2 or xv.dtype != wv.dtype:
        raise _Skip(f"hidden states {x!r} {xv.shape} {xv.dtype} and weight {wv.dtype} do not fit")
    if chunk_size is None:
        chunk_size = max(1, min(DEFAULT_CHUNK_TOKENS, chunk_bytes // (4 * classes)))
    return Fusion(
        loss=loss_op.outputs[0],
        x=x,
        weight=weight,
        bias=bias,
        labels=labels,
        trans_b=trans_b,
        classes=classes,
        chunk_size=chunk_size,
        absorbed=tuple(sorted(absorbed)),
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


def fuse_linear_cross_entropy(
    p: Program,
    *,
    min_classes: int = MIN_CLASSES,
    chunk_size: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    fetches: Sequence[str] = (),
    plan: FuseLinearCrossEntropyPlan | None = None,
) -> Program:
    """A copy of `p` with every head + loss the plan fuses rewritten into one `LinearCrossEntropy`
    (module doc); `plan`: the one `plan_fuse_linear_cross_entropy` made for these arguments."""
    if plan is None:
        plan = plan_fuse_linear_cross_entropy(
            p, min_classes=min_classes, chunk_size=chunk_size, chunk_bytes=chunk_bytes, fetches=fetches
        )
    q = p.clone()
    if not plan.fused:
        return q
    drop: set[int] = set()
    replace: dict[int, Op] = {}
    for f in plan.fused:
        drop.update(f.absorbed)
        loss_op = q.ops[f.anchor]
        # The chain's values, as computed from the hidden states instead of the logits: the row
        # slices read (the moved copy of) x; identities, reshapes and the bias add pass it on.
        on_x = {}
        for k in sorted(set(f.absorbed) | set(f.moved)):
            op = q.ops[k]
            out = op.outputs[0]
            if k in f.moved:
                src = on_x.get(op.inputs[0], f.x)
                op.inputs[0] = src
                # same name, now the sliced hidden states: [..rows.., H] in x's dtype
                v = q.vars[out]
                v.shape = (*v.shape[:-1], q.vars[f.x].shape[-1])
                v.dtype = q.vars[f.x].dtype
                on_x[out] = out
            elif op.type in ("Identity", "Reshape", "Add"):
                src = op.inputs[0] if op.type != "Add" else next(x for x in op.inputs if x != f.bias)
                on_x[out] = on_x.get(src, f.x)
            else:  # the head (and its Transpose): its output is the logits, i.e. x itself
                on_x[out] = f.x
        scores = loss_op.inputs[0]
        x = on_x.get(scores, f.x)
        attrs = {
            "ignore_index": loss_op.attrs.get("ignore_index", -100),
            "reduction": loss_op.attrs.get("reduction", "mean"),
            "chunk_size": f.chunk_size,
            "transB": f.trans_b,
        }
        inputs = [x, f.weight, f.labels] + ([f.bias] if f.bias else [])
        replace[f.anchor] = Op(
            "LinearCrossEntropy",
            inputs,
            [f.loss],
            attrs,
            role=loss_op.role,
            scope=loss_op.scope,
            origin=loss_op.origin,
        )
    before = {o for op in q.ops for o in op.outputs if o}
    q.ops = [replace.get(i, op) for i, op in enumerate(q.ops) if i not in drop]
    alive = {o for op in q.ops for o in op.outputs if o}
    for name in before - alive:
        q.vars.pop(name, None)
    gone = before - alive
    q.modules = {m: [v for v in vs if v not in gone] for m, vs in q.modules.items()}
    q.modules = {m: vs for m, vs in q.modules.items() if vs}
    return q

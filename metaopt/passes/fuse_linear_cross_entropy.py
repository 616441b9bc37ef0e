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
from metaopt.ops import lm_head
from metaopt.ops.kernels.loss import DEFAULT_CHUNK_TOKENS
from metaopt.passes.one_call import one_call

# Fewer classes than this is a classifier head: its logits are small, chunking buys nothing.
MIN_CLASSES = 1024
# A chunk's float32 logits are at most this many bytes (and one chunk is at most
# DEFAULT_CHUNK_TOKENS tokens): 64 MiB is 334 tokens of GPT-2's 50257 classes.
CHUNK_BYTES = 64 * 2**20


class FuseLinearCrossEntropyError(ValueError):
    pass


@dataclass(frozen=True)
class Fusion(lm_head.HeadMatch):
    """One head + loss fused (the match, `lm_head.HeadMatch`) and the chunk size it runs with."""

    chunk_size: int

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
        if not lm_head.is_loss(op):
            continue
        try:
            m = lm_head.match(p, i, producers, consumers, kept, min_classes)
        except lm_head.NotFused as e:
            plan.skipped.append(Skipped(op.outputs[0], str(e)))
            continue
        size = chunk_size or max(1, min(DEFAULT_CHUNK_TOKENS, chunk_bytes // (4 * m.classes)))
        plan.fused.append(Fusion(**vars(m), chunk_size=size))
    return plan


def apply_fuse_linear_cross_entropy(p: Program, plan: FuseLinearCrossEntropyPlan) -> Program:
    """A copy of `p` with every head + loss `plan` fuses rewritten into one `LinearCrossEntropy`
    (module doc)."""
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
            elif k in f.chain:  # identities, reshapes, the bias add: pass the value on
                on_x[out] = on_x.get(lm_head.forwarded_input(op, f.bias), f.x)
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


fuse_linear_cross_entropy = one_call(plan_fuse_linear_cross_entropy, apply_fuse_linear_cross_entropy)

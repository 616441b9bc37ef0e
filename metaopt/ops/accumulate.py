"""A lookup's weight grad added straight into the weight's other grad contribution.

A tied embedding (BERT's MLM decoder, GPT's LM head) gets two grad contributions: the head's,
made at the start of the backward, and the lookup's (``EmbeddingGrad``), made at its end and
summed into the first by ``GradAccumulate``. For that moment both vocab x width buffers are
alive. ``EmbeddingGradAccumulate`` adds each looked-up row into the first contribution in
place instead, so only one exists. The sum is the same up to float rounding (each row is
added into the accumulator rather than summed per index first), so this is used where the
memory matters more than bit-equality with the unfused backward (optimizer_in_backward,
passes/update_in_backward.py), judged by the float64 metric.

Op knowledge for that pass: which ops form the pattern (the pass switches on no op type).
"""

from __future__ import annotations

from dataclasses import dataclass

from metaopt.ir import Op, Program

LOOKUP_GRAD = "EmbeddingGrad"
ACCUMULATE = "GradAccumulate"
FUSED = "EmbeddingGradAccumulate"


@dataclass(frozen=True)
class Accumulation:
    lookup: int  # index of the EmbeddingGrad op
    accumulate: int  # index of the GradAccumulate op that reads its output
    op: Op  # the fused op, to stand where the lookup's grad was


def find(p: Program) -> tuple[list[Accumulation], list[str]]:
    """Every EmbeddingGrad whose output only a two-input GradAccumulate reads, with the
    accumulator made before it; and why other EmbeddingGrads are left alone."""
    made = {o: i for i, op in enumerate(p.ops) for o in op.outputs if o}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(p.ops):
        for x in op.inputs:
            readers.setdefault(x, []).append(i)
    found, skipped = [], []
    for i, op in enumerate(p.ops):
        if op.type != LOOKUP_GRAD:
            continue
        out = op.outputs[0]
        why = _unfusable(p, op, readers.get(out, []), made)
        if why:
            skipped.append(f"{LOOKUP_GRAD} of {op.inputs[2]!r}: {why}")
            continue
        j = readers[out][0]
        acc_op = p.ops[j]
        acc = next(x for x in acc_op.inputs if x != out)
        fused = Op(
            FUSED,
            [acc, op.inputs[0], op.inputs[1]],
            list(acc_op.outputs),
            {"padding_idx": int(op.attrs.get("padding_idx", -1))},
            role=acc_op.role,
            scope=op.scope,
            origin=acc_op.origin,
        )
        found.append(Accumulation(i, j, fused))
    return found, skipped


def _unfusable(p: Program, op: Op, readers: list[int], made: dict[str, int]) -> str:
    if op.attrs.get("scale_grad_by_freq"):
        return "scale_grad_by_freq scales by counts over the whole batch"
    if len(readers) != 1 or p.ops[readers[0]].type != ACCUMULATE or len(p.ops[readers[0]].inputs) != 2:
        return "its grad is not summed into one other contribution"
    acc = next(x for x in p.ops[readers[0]].inputs if x != op.outputs[0])
    if p.ops[readers[0]].inputs[0] != acc:
        return "its own grad is the accumulator (nothing to add into)"
    if made.get(acc, len(p.ops)) > made[op.outputs[0]]:
        return "the other contribution is made after it"
    if p.vars[acc].dtype != p.vars[op.outputs[0]].dtype:
        return "the contributions' dtypes differ"
    return ""

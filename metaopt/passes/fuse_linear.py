"""Fold torch's exported Linear back into one op: Transpose(W) -> MatMul -> Add(b) => Linear(x, W, b).

torch.onnx.export writes an nn.Linear on a >2-D input as three ops; running them
as such costs a separate pass over the output for the bias (and a transposed
view per step). `Linear` (ours, saved with an ONNX function body) is one
`F.linear` call, as in eager torch.

Which ops fold into what is per-op knowledge: a row's `fuse` rule (ops/registry.py), tried on
every forward op whose row has one (MatMul's: only params qualify, only with a bias, and only
when the intermediate values have no other reader; ops/kernels/nn.py). This pass applies what
the rules match: the fused op takes the matched op's place, the ops it absorbs are dropped.
"""

from __future__ import annotations

from metaopt.ir import Op, Program
from metaopt.ops import registry


def fuse_linear(p: Program) -> Program:
    q = p.clone()
    consumers = q.consumers()
    producer = q.producers()
    drop: set[int] = set()
    replace: dict[int, Op] = {}
    for i, op in enumerate(q.ops):
        row = registry.get(op.type)
        if row is None or row.fuse is None or op.role != "forward":
            continue
        match = row.fuse(q, i, producer, consumers)
        if match is None:
            continue
        absorbed, fused = match
        if {i, *absorbed} & (drop | set(replace)):
            continue  # an op already taken by an earlier match
        drop.update(absorbed)
        replace[i] = fused
    q.ops = [replace.get(i, op) for i, op in enumerate(q.ops) if i not in drop or i in replace]
    produced = {o for op in q.ops for o in op.outputs}
    for op in [p.ops[i] for i in drop] + [p.ops[i] for i in replace]:
        for name in op.outputs:
            if name not in produced:
                q.vars.pop(name, None)
    return q

"""Pattern fusion: one driver over the op table's `fuse` rules (ops/registry.py `OpDef.fuse`).

Which ops fold into what is per-op knowledge, held by the row of the pattern's anchor op:
MatMul's rule folds torch's exported nn.Linear (``Add(MatMul(x, Transpose(W)), b)``) into
`Linear` (ops/kernels/nn.py); Tanh's and Erf's fold the elementwise chains of the tanh and erf
GELU into `Gelu` (ops/kernels/activation.py). A rule is called as

    fuse(program, op_index, producers, consumers) -> (absorbed op indices, replacing op) | None

and this pass applies what the rules match, in one sweep over the forward ops: the fused op
takes the anchor's place, the absorbed ops are dropped, and so are the vars only they produced
and the constants only they read.
A match that touches an op an earlier match already took is skipped, and so is one that would
drop a program output or a state update (rules check the readers of what they absorb; these two
are the driver's, the same for every rule).
"""

from __future__ import annotations

from metaopt.ir import Op, Program
from metaopt.ops import registry


def fuse(p: Program) -> Program:
    """The program with every op-table fusion applied (pure: `p` is left as it was)."""
    q = p.clone()
    drop, replace = _matches(q)
    q.ops = [replace.get(i, op) for i, op in enumerate(q.ops) if i not in drop or i in replace]
    _drop_orphans(q, [p.ops[i] for i in sorted(drop | set(replace))])
    return q


def _drop_orphans(q: Program, gone: list[Op]) -> None:
    """Remove the vars only the replaced ops made, and the constants only they read."""
    produced = {o for op in q.ops for o in op.outputs}
    read = {x for op in q.ops for x in op.inputs} | set(q.outputs)
    for op in gone:
        for name in op.outputs:
            if name not in produced:
                q.vars.pop(name, None)
        for name in op.inputs:
            v = q.vars.get(name)
            if v is not None and v.kind == "constant" and name not in read:
                q.vars.pop(name)
                q.values.pop(name, None)


def _matches(q: Program) -> tuple[set[int], dict[int, Op]]:
    """(indices of the absorbed ops, anchor index -> its fused op) over the forward ops."""
    consumers = q.consumers()
    producer = q.producers()
    kept = set(q.outputs) | set(q.updates.values())
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
        lost = {o for j in (i, *absorbed) for o in q.ops[j].outputs} - set(fused.outputs)
        if lost & kept:
            continue  # the program still names a value the fusion would remove
        drop.update(absorbed)
        replace[i] = fused
    return drop, replace

"""Pattern fusion: one driver over the op table's `fuse` rules (ops/registry.py `OpDef.fuse`).

Which ops fold into what is per-op knowledge, held by the row of the pattern's anchor op:
MatMul's rule folds torch's exported nn.Linear (``Add(MatMul(x, Transpose(W)), b)``) into
`Linear` (ops/kernels/nn.py); Tanh's and Erf's fold the elementwise chains of the tanh and erf
GELU into `Gelu` (ops/kernels/activation.py). A rule is called as

    fuse(program, op_index, producers, consumers) -> (absorbed op indices, replacing op) | None

and this pass applies what the rules match, in one sweep over the forward ops: the fused op
stands where the last op making one of its outputs stood (every value it reads is made by then,
and nothing reads its outputs earlier than before: a SiLU-gated MLP's up projection comes after
the gate's Sigmoid), the other ops of the match are dropped, and so are the vars only they
produced and the constants only they read.
A match that touches an op an earlier match already took is skipped, and so is one that would
drop a program output or a state update, or one whose op could stand nowhere (an input made
after its outputs are read). Rules check the readers of what they absorb; these checks are the
driver's, the same for every rule.
"""

from __future__ import annotations

from metaopt.ir import Op, Program
from metaopt.ops import registry


def fuse(p: Program) -> Program:
    """The program with every op-table fusion applied (pure: `p` is left as it was)."""
    q = p.clone()
    drop, replace = _matches(q)
    q.ops = [replace.get(i, op) for i, op in enumerate(q.ops) if i not in drop]
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
    """(indices of the ops the matches remove, index -> the fused op standing there)."""
    consumers = q.consumers()
    producer = q.producers()
    kept = set(q.outputs) | set(q.updates.values())
    taken: set[int] = set()
    replace: dict[int, Op] = {}
    for i, op in enumerate(q.ops):
        row = registry.get(op.type)
        if row is None or row.fuse is None or op.role != "forward":
            continue
        match = row.fuse(q, i, producer, consumers)
        if match is None:
            continue
        absorbed, fused = match
        ops = {i, *absorbed}
        if ops & taken:
            continue  # an op already taken by an earlier match
        lost = {o for j in ops for o in q.ops[j].outputs} - set(fused.outputs)
        if lost & kept:
            continue  # the program still names a value the fusion would remove
        at = _place(fused, ops, producer, consumers)
        if at is None:
            continue
        taken |= ops
        replace[at] = fused
    return taken - set(replace), replace


def _place(fused: Op, ops: set[int], producer: dict[str, int], consumers: dict[str, list[int]]) -> int | None:
    """Where `fused` may stand in place of `ops`: the last of them making one of its outputs,
    when every input is made before it and no reader outside the match reads an output earlier."""
    made = [producer[o] for o in fused.outputs if o in producer and producer[o] in ops]
    if not made:
        return None
    at = max(made)
    if any(producer.get(x, -1) >= at or producer.get(x) in ops for x in fused.inputs if x):
        return None
    if any(r < at and r not in ops for o in fused.outputs if o for r in consumers.get(o, [])):
        return None
    return at

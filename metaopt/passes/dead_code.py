"""Remove ops whose outputs nobody reads, and vars nothing refers to."""

from __future__ import annotations

from metaopt.ir import Program
from metaopt.ops import registry


def dead_code(p: Program) -> Program:
    """Drop dead forward ops (never random ones: they consume the RNG stream)."""
    q = p.clone()
    live = set(q.outputs) | set(q.updates.values()) | set(q.updates)
    keep = []
    for op in reversed(q.ops):
        row = registry.get(op.type)
        # an op without outputs is there for its effect (Send, CopyWait): never dead
        removable = op.role == "forward" and row is not None and not row.random and bool(op.outputs)
        if removable and not any(o and o in live for o in op.outputs):
            continue
        keep.append(op)
        live.update(x for x in op.inputs if x)
    q.ops = keep[::-1]
    used = live | set(q.inputs) | {o for op in q.ops for o in op.outputs if o}
    for name in [n for n, v in q.vars.items() if n not in used and v.kind in ("constant", "activation")]:
        del q.vars[name]
        q.values.pop(name, None)
    return q

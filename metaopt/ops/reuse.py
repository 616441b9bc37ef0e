"""Which ops write their output into an input that dies there (the rows' `reuse` field).

Eager torch writes ``relu(inplace=True)`` and ``out += identity`` by hand; a static program
knows every value's last reader, so it can do the same wherever it is safe, without the user
asking. The executor's plan binds the row's in-place kernel for the ops chosen here, and
`estimate_memory` counts the output on the input's storage: both call `plan_reuse`, so the
prediction and the measurement stay equal.

An op's output 0 goes into input ``j``'s storage only when all of this holds:

* the row lists ``j`` in its `reuse` inputs, and input ``j`` has the output's shape and dtype
  (every dim known), and every input has the output's dtype (no type promotion);
* input ``j`` owns its storage: a kernel made it fresh from inputs (not a view, not a
  pass-through, not a runtime's reused buffer, not an attribute a Constant hands back, not a
  feed, a param, state or a constant), or it is itself such a reuse of an owned storage;
* nothing sharing that storage (the input, its views, what it was written over) is read after
  this op, fetched, or read by an op that may still be reading it asynchronously (copies,
  sends, collectives: rows with `needs_runtime`), and no other input of the op is a view of it.

Values are bit for bit those of the out-of-place kernel: the in-place kernels are the same ATen
elementwise loops writing to another address. Only allocations (and, on CPU, the page faults of
touching fresh memory) go away.
"""

from __future__ import annotations

from collections.abc import Iterable

from metaopt.ir import Program
from metaopt.ir.liveness import liveness
from metaopt.ops import registry


class _Storages:
    """Union-find of vars sharing storage; per class: may it be written, and its last read."""

    def __init__(self, p: Program, last: dict[str, int]) -> None:
        self.p, self.last = p, last
        self.inputs = set(p.inputs)
        self.parent: dict[str, str] = {}
        self.writable: dict[str, bool] = {}
        self.until: dict[str, int] = {}

    def find(self, x: str) -> str:
        if x not in self.parent:
            v = self.p.vars.get(x)
            self.parent[x] = x
            self.writable[x] = v is not None and not v.persistable and x not in self.inputs
            self.until[x] = self.last.get(x, -1)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb
            self.writable[rb] = self.writable[rb] and self.writable[ra]
            self.until[rb] = max(self.until[rb], self.until[ra])

    def pin(self, x: str) -> None:
        """Never write `x`'s storage (an asynchronous reader may still hold it)."""
        self.writable[self.find(x)] = False


def _same_layout(p: Program, x: str, out: str) -> bool:
    vx, vo = p.vars.get(x), p.vars.get(out)
    if vx is None or vo is None or vx.shape is None or vo.shape is None or vx.dtype != vo.dtype:
        return False
    return tuple(vx.shape) == tuple(vo.shape) and None not in vx.shape


def plan_reuse(p: Program, fetches: Iterable[str] = ()) -> dict[int, int]:
    """op index -> the input index whose storage its output 0 is written into (module doc)."""
    last, _ = liveness(p, fetches)
    st = _Storages(p, last)
    owned: set[str] = set()
    chosen: dict[int, int] = {}
    rows: dict[str, registry.OpDef | None] = {}
    for i, op in enumerate(p.ops):
        row = rows[op.type] if op.type in rows else rows.setdefault(op.type, registry.get(op.type))
        j = _pick(p, i, op, row, st, owned)
        if j is not None:
            chosen[i] = j
            st.union(op.outputs[0], op.inputs[j])
            owned.add(op.outputs[0])
            continue
        if row is None or row.needs_runtime or row.host_memory is not None:
            for x in op.inputs:  # an unknown op, or one that may read its inputs asynchronously
                if x:
                    st.pin(x)
        _link(p, op, row, st, owned)
    return chosen


def _pick(p: Program, i: int, op, row, st: _Storages, owned: set[str]) -> int | None:  # noqa: ANN001
    if row is None or row.reuse is None or not op.outputs or not op.outputs[0]:
        return None
    out = op.outputs[0]
    dtype = p.vars[out].dtype
    if any(x and p.vars[x].dtype != dtype for x in op.inputs):
        return None
    for j in row.reuse[0]:
        x = op.inputs[j] if j < len(op.inputs) else ""
        if not x or x not in owned or not _same_layout(p, x, out):
            continue
        r = st.find(x)
        # another input on the same storage (a transposed view of x) would be read while x is
        # written: torch refuses partial overlaps; only x itself (Add(x, x)) may be read again
        others = any(y and y != x and st.find(y) == r for y in op.inputs)
        if st.writable[r] and st.until[r] <= i and not others:
            return j
    return None


def _link(p: Program, op, row, st: _Storages, owned: set[str]) -> None:  # noqa: ANN001
    """Record the op's outputs: which share storage with its inputs, which are fresh."""
    shared: set[int] = set()
    if row is None:
        pairs = [(k, j) for k in range(len(op.outputs)) for j in range(len(op.inputs))]
    else:
        pairs = list(registry.alias_pairs(op) or ()) + list(row.inplace)
    for k, j in pairs:
        o = op.outputs[k] if k < len(op.outputs) else ""
        x = op.inputs[j] if j < len(op.inputs) else ""
        if o and x:
            st.union(o, x)
            shared.add(k)
    fresh = (
        row is not None
        and not row.needs_runtime
        and row.host_memory is None
        and not row.view
        and row.view_if is None
        # an op with no inputs may hand back a tensor its attrs hold (Constant's value, on the
        # CPU the very same storage every run): never written over
        and any(op.inputs)
    )
    written = {k: j for k, j in (row.inplace if row is not None else ())}
    for k, o in enumerate(op.outputs):
        if o:
            st.find(o)
            if fresh and k not in shared:
                owned.add(o)
            elif k in written and written[k] < len(op.inputs) and op.inputs[written[k]] in owned:
                owned.add(o)  # written in place over an owned storage (GradAccumulate)

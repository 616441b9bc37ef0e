"""Predicted peak of live bytes, from the program alone (no run), for a given batch.

It replays what the executor does: persistables, constants and feeds are live from
the start; each op's outputs become live when it runs (a `view` row's outputs share
their input's storage and add nothing, as do outputs written in place into an
input); a value dies after its last reader, and its
storage when the last value holding it dies. The executor's own accounting is the
measurement this predicts (`exe.memory_stats()["peak_bytes"]`).

An op whose row declares a `workspace` (a chunked kernel: LinearCrossEntropy holds one chunk
of logits while it runs) adds those bytes at that op. The executor counts vars, not a kernel's
temporaries, so with ``workspace=False`` the estimate is what it measures; the default counts
them, as the device (``torch.cuda.max_memory_allocated``) does.
"""

from __future__ import annotations

from dataclasses import dataclass

from metaopt.ir import Program, eval_dim
from metaopt.ir.liveness import liveness
from metaopt.ops import registry


@dataclass
class MemoryEstimate:
    peak_bytes: int
    persistable_bytes: int
    peak_op: int  # index of the op at which the peak is reached

    @property
    def activation_peak_bytes(self) -> int:
        return self.peak_bytes - self.persistable_bytes


def estimate_memory(
    p: Program, *, dims: dict[str, int], fetches: tuple[str, ...] = (), workspace: bool = True
) -> MemoryEstimate:
    """The peak of live bytes when `p` runs with symbolic dims bound by `dims`; `workspace`:
    add the temporaries of ops whose rows declare them (module doc)."""

    def nbytes(name: str) -> int:
        return p.vars[name].nbytes(dims) or 0

    def shape(name: str) -> tuple | None:
        v = p.vars.get(name) if name else None
        if v is None or v.shape is None:
            return None
        bound = tuple(eval_dim(d, dims) for d in v.shape)
        return None if None in bound else bound

    def op_workspace(op, row) -> int:
        if not workspace or row is None or row.workspace is None:
            return 0
        dtypes = [p.vars[x].dtype if x else "" for x in op.inputs]
        return row.workspace(op.attrs, [shape(x) for x in op.inputs], dtypes)

    last, _ = liveness(p, [f for f in (*fetches, p.loss_name) if f])
    persistent = {v.name for v in p.vars.values() if v.persistable}
    storage: dict[str, str] = {}  # var -> the var whose storage it uses
    refs: dict[str, int] = dict.fromkeys(persistent, 1)  # state never dies
    live = persistable = sum(nbytes(x) for x in persistent)
    for x in p.inputs:
        if x in last:
            storage[x], refs[x] = x, 1
            live += nbytes(x)
    peak, peak_op = live, -1
    host: set[str] = set()  # storages in host memory
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        # Which input's storage each output reuses: a view's input 0; an in-place pair's input.
        shares = {k: j for k, j in (row.inplace if row is not None else ())}
        if row is not None and row.view:
            shares.update({k: 0 for k in range(len(op.outputs))})
        # Outputs in host memory (offload's copies) are not device bytes: the executor
        # counts them in its host account.
        on_host = row is not None and row.host_memory is not None and row.host_memory(op.attrs)
        for k, o in enumerate(op.outputs):
            if not o:
                continue
            src = op.inputs[shares[k]] if k in shares and shares[k] < len(op.inputs) else ""
            s = storage.get(src, src) if src in storage or src in persistent else o
            storage[o] = s
            if s == o and on_host:
                host.add(o)
            refs[s] = refs.get(s, 0) + 1
            if s == o and not on_host:
                live += nbytes(o)
        transient = op_workspace(op, row)
        if live + transient > peak:
            peak, peak_op = live + transient, i
        for x in {*op.inputs, *op.outputs}:
            if x and x in storage and x not in persistent and last.get(x) == i:
                s = storage.pop(x)
                refs[s] -= 1
                if refs[s] == 0 and s not in host:
                    live -= nbytes(s)
    return MemoryEstimate(peak, persistable, peak_op)

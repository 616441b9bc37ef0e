"""ZeRO-Offload's optimizer state: held in host memory between steps, brought to the device per
bucket for its updates.

    plan = plan_state_offload(program, bucket_bytes=32 << 20)
    program = apply_state_offload(program, plan)

Fleet's ``sharding_configs["optimize_offload"]`` (the step ``state_offload``, after
``sharding``). Every update op with state (Momentum's velocity, Adam's moments; ZeRO's slices
where sharded) gets, per bucket of at most `bucket_bytes` of state in update order::

    w@MOMENT1@FETCH = Memcpy(w@MOMENT1, dst=device)             # role=optimize origin=w@MOMENT1
    w@NEW, w@MOMENT1@NEW, ... = AdamUpdate(..., w@MOMENT1@FETCH, ...)
    w@MOMENT1@NEW@PINNED = Memcpy(w@MOMENT1@NEW, dst=pinned)    # role=optimize origin=w@MOMENT1

the fetches before the bucket's first update, the copies back after its last, and
``program.updates[w@MOMENT1] = w@MOMENT1@NEW@PINNED``; the state vars are declared ``host``
(`Var.host`): the executor keeps them in (pinned) host memory and counts them as host bytes, as
`estimate_memory` does. The update itself runs on the device, a bucket's state there only from
its fetch to its copy back: the device holds one bucket of state at a time instead of all of it
(DeepSpeed's ZeRO-Offload runs the update on the host instead; here every op runs on the
executor's one device). On a CPU-only machine both memories are the host's: the placement shows
in the program, the plan and the memory report, and the copies are real copies.

Exact: the update reads a copy of the very values and its result is copied back. A skipped
AMP step keeps the old state: the update's outputs are then its inputs, and the copy back is of
them (``Memcpy``'s row: ``state_from_updates``). Pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Var, names
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry
from metaopt.passes.one_call import one_call


class StateOffloadError(ValueError):
    pass


@dataclass
class OffloadedUpdate:
    op: int  # index of the update op
    states: list[str]  # its state inputs, in its output order
    news: list[str]  # the values that replace them (program.updates)
    nbytes: int  # the states' bytes as this worker holds them


@dataclass
class StateBucket:
    updates: list[OffloadedUpdate]
    nbytes: int

    @property
    def first(self) -> int:
        return self.updates[0].op

    @property
    def last(self) -> int:
        return self.updates[-1].op


@dataclass
class StateOffloadPlan:
    bucket_bytes: int
    buckets: list[StateBucket] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # update ops without state, and why

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def __str__(self) -> str:
        n = sum(len(u.states) for b in self.buckets for u in b.updates)
        cap = f"{self.bucket_bytes / 2**20:g} MB" if self.bucket_bytes else "one update per"
        largest = max((b.nbytes for b in self.buckets), default=0)
        lines = [
            f"optimizer state offload: {n} state tensors, {self.nbytes:,} bytes held in host memory; "
            f"brought to the device in {len(self.buckets)} bucket(s) ({cap} buckets) for the updates, "
            f"at most {largest:,} bytes of state there at once"
        ]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def plan_state_offload(p: Program, *, bucket_bytes: int = 32 << 20) -> StateOffloadPlan:
    """The update ops whose state goes to host memory, in buckets of `bucket_bytes` (0: one
    update per bucket)."""
    if bucket_bytes < 0:
        raise StateOffloadError(f"optimizer offload: bucket_bytes must be >= 0, got {bucket_bytes}")
    held = [v.name for v in p.vars.values() if v.host]
    if held:
        raise StateOffloadError(
            f"optimizer offload: {held[0]!r} is in host memory already: is the state offloaded twice?"
        )
    plan = StateOffloadPlan(bucket_bytes)
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        if row is None or not row.update:
            continue
        new_of = {p.updates[x]: x for x in op.inputs if x in p.updates}
        states = [new_of[o] for o in op.outputs[1:] if o in new_of]
        if not states:
            plan.skipped.append(f"`{fmt_op(op)}`: no optimizer state")
            continue
        news = [p.updates[s] for s in states]
        u = OffloadedUpdate(i, states, news, sum(p.vars[s].nbytes({}) or 0 for s in states))
        b = plan.buckets[-1] if plan.buckets else None
        if b is not None and bucket_bytes and b.nbytes + u.nbytes <= bucket_bytes:
            b.updates.append(u)
            b.nbytes += u.nbytes
        else:
            plan.buckets.append(StateBucket([u], u.nbytes))
    return plan


def apply_state_offload(p: Program, plan: StateOffloadPlan) -> Program:
    """A clone of `p` whose planned state lives in host memory (see the module doc)."""
    q = p.clone()
    firsts = {b.first: b for b in plan.buckets}
    lasts = {b.last: b for b in plan.buckets}
    fetched = {u.op: u for b in plan.buckets for u in b.updates}
    ops: list[Op] = []
    for i, op in enumerate(p.ops):
        if i in firsts:
            ops += [_fetch(q, s) for u in firsts[i].updates for s in u.states]
        if i in fetched:
            renames = {s: names.fetch(s) for s in fetched[i].states}
            op = dataclasses.replace(op, inputs=[renames.get(x, x) for x in op.inputs])
        ops.append(op)
        if i in lasts:
            for u in lasts[i].updates:
                ops += [_copy_back(q, s, new) for s, new in zip(u.states, u.news, strict=True)]
    q.ops = ops
    return q


def _fetch(q: Program, s: str) -> Op:
    v = q.vars[s]
    q.vars[s] = dataclasses.replace(v, host=True)
    q.vars[s].program = q
    out = _fresh(q, names.fetch(s))
    q.add_var(Var(out, v.dtype, v.shape, "activation", zero=v.zero))
    return Op("Memcpy", [s], [out], {"dst": "device"}, role="optimize", origin=s)


def _copy_back(q: Program, s: str, new: str) -> Op:
    v = q.vars[new]
    out = _fresh(q, names.pinned(new))
    q.add_var(Var(out, v.dtype, v.shape, v.kind, zero=v.zero))
    q.updates[s] = out
    return Op("Memcpy", [new], [out], {"dst": "pinned"}, role="optimize", origin=s)


def _fresh(q: Program, name: str) -> str:
    if name in q.vars:
        raise StateOffloadError(f"optimizer offload: {name!r} exists already: is the state offloaded twice?")
    return name


state_offload = one_call(plan_state_offload, apply_state_offload)

"""`verify(program)`: the IR's invariants, each failure naming the printed line at fault."""

from __future__ import annotations

from metaopt.ir import roles
from metaopt.ir.printer import fmt_op
from metaopt.ir.program import Op, Program


class VerifyError(ValueError):
    pass


def _fail(p: Program, i: int, op: Op, msg: str) -> VerifyError:
    # Line number as printed: header lines, one per var, modules block, "ops:".
    header = 3 + (p.loss_name is not None) + (p.pipeline is not None) + (p.gradient_merge is not None)
    header += 1 + len(p.vars)
    header += len(p.modules) + 1 if p.modules else 0
    header += (len(p.updates) + 1 if p.updates else 0) + 1
    return VerifyError(f"{p.name}: line {header + i + 1} (op {i}): {msg}\n  {fmt_op(op)}")


def verify(p: Program) -> None:
    """Raise VerifyError on the first broken invariant."""
    for name in [*p.inputs, *p.outputs]:
        if name not in p.vars:
            raise VerifyError(f"{p.name}: input/output {name!r} is not a declared var")
    for name in p.inputs:
        if p.vars[name].kind != "input":
            raise VerifyError(f"{p.name}: program input {name!r} has kind {p.vars[name].kind!r}, not 'input'")
    defined = set(p.inputs) | {v.name for v in p.persistables()}
    for v in p.vars.values():
        if v.kind == "constant" and v.name not in p.values:
            raise VerifyError(f"{p.name}: constant {v.name!r} has no value")
    producer: dict[str, int] = {}
    phase = 0
    stage_of: dict[str, int | None] = {}
    place = p.pipeline.placement if p.pipeline is not None else None

    def worker(stage: int) -> int:  # a worker's chunks (interleaved, ZB-V) share its values
        return place.worker(stage) if place is not None else stage

    # Per role, looked up once: a 100k-op program has a handful of roles. The loop below runs
    # once per op and is what a 100k-op program's verify costs: locals, one lookup per name.
    rank: dict[str, int | None] = {}
    startup: dict[str, bool] = {}
    declared = p.vars
    program_inputs = set(p.inputs)
    for i, op in enumerate(p.ops):
        role = op.role
        if role not in rank:
            rank[role], startup[role] = roles.phase_rank(role), roles.is_startup(role)
        if startup[role]:
            _check_startup(p, i, op)
        stage = op.stage
        for x in op.inputs:
            if not x:
                continue
            if x not in defined:  # (everything defined is declared)
                if x not in declared:
                    raise _fail(p, i, op, f"input {x!r} is not a declared var")
                raise _fail(p, i, op, f"input {x!r} is used before it is defined")
            if stage is not None:
                src = stage_of.get(x)
                if src is not None and worker(src) != worker(stage):
                    raise _fail(p, i, op, f"input {x!r} comes from stage {src} without a Send/Recv pair")
        for o in op.outputs:
            if not o:
                continue
            var = declared.get(o)
            if var is None:
                raise _fail(p, i, op, f"output {o!r} is not a declared var")
            if o in producer:
                raise _fail(
                    p, i, op, f"output {o!r} is already produced by op {producer[o]} (SSA: one producer)"
                )
            if var.persistable:
                raise _fail(
                    p,
                    i,
                    op,
                    f"output {o!r} is persistable ({var.kind}); write it through program.updates",
                )
            if o in program_inputs:
                raise _fail(p, i, op, f"output {o!r} is a program input")
            producer[o] = i
            defined.add(o)
            if stage is not None:  # a missing entry reads as None, like an unstaged op's
                stage_of[o] = stage
        # Once an op of a later phase has run, no op of an earlier phase may follow; roles
        # the table does not order (offload, comm, lr-sched) may appear in any phase.
        ph = rank[role]
        if ph is not None:
            if ph < phase:
                raise _fail(p, i, op, f"role {op.role} after a later phase has begun (roles out of order)")
            phase = ph
    _check_offloads(p, set(rank))
    _check_updates(p, defined)
    for name in p.outputs:
        if name not in defined:
            raise VerifyError(f"{p.name}: output {name!r} is never produced")
    if p.loss_name is not None:
        loss = p.vars.get(p.loss_name)
        if loss is None or p.loss_name not in defined:
            raise VerifyError(f"{p.name}: loss {p.loss_name!r} is not produced by the program")
        if loss.shape not in (None, ()):
            raise VerifyError(
                f"{p.name}: loss {p.loss_name!r} must be a scalar, has shape {list(loss.shape)}"
            )


def _check_offloads(p: Program, seen: set[str]) -> None:
    """`seen`: the roles of `p`'s ops."""
    if "offload" not in seen:
        return
    if not any(roles.is_backward(r) or r == "prefetch" for r in seen):
        return  # a forward alone (a pipeline's forward part): the backward fetches it back
    consumers = p.consumers()
    for i, op in enumerate(p.ops):
        if op.role != "offload":
            continue
        for o in op.outputs:
            if not any(p.ops[j].role == "prefetch" for j in consumers.get(o, [])):
                raise _fail(p, i, op, f"offloaded {o!r} is never fetched back by a prefetch op")


def _check_startup(p: Program, i: int, op: Op) -> None:
    """A startup op (run once, before the first run) comes before every other op, reads only
    persistables (it writes them in place) and has no outputs."""
    if not roles.is_startup(op.role):
        return
    if i > 0 and not roles.is_startup(p.ops[i - 1].role):
        raise _fail(p, i, op, "a startup op must come before every other op (it runs before the first run)")
    if any(op.outputs):
        raise _fail(p, i, op, "a startup op writes persistables in place: it has no outputs")
    for x in op.inputs:
        if x and (x not in p.vars or not p.vars[x].persistable or p.vars[x].kind == "constant"):
            raise _fail(p, i, op, f"a startup op reads persistables only (params, buffers): {x!r} is not one")


def _check_updates(p: Program, defined: set[str]) -> None:
    for target, new in p.updates.items():
        t, n = p.vars.get(target), p.vars.get(new)
        if t is None or not t.persistable:
            raise VerifyError(f"{p.name}: update target {target!r} is not a persistable var")
        if n is None or new not in defined or n.persistable:
            raise VerifyError(f"{p.name}: update {target!r} <- {new!r}: {new!r} is not produced by an op")
        if (t.dtype, t.shape) != (n.dtype, n.shape):
            raise VerifyError(
                f"{p.name}: update {target!r} <- {new!r}: {t.dtype}{list(t.shape or [])} "
                f"vs {n.dtype}{list(n.shape or [])}"
            )

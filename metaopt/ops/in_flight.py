"""Collectives left in flight (a row's `wait_op`, attr ``overlap=1``): each output holds its value
only after the wait op reads them all, so nothing may read one before (passes/overlap_comm.py
places the waits; the executor checks every program it plans, since a program edited after
`minimize` could move a reader ahead of its wait and read a buffer still travelling)."""

from __future__ import annotations

from metaopt.ir import Op, Program
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry


class InFlightError(ValueError):
    pass


def wait_ops() -> set[str]:
    """The op types that finish a collective left in flight (rows' `wait_op`)."""
    return {row.wait_op for row in registry.table().values() if row.wait_op}


def is_wait(op: Op) -> bool:
    return op.type in wait_ops()


def check_in_flight(p: Program) -> None:
    """Every collective left in flight is waited for once, over all its outputs, before any
    other op reads one of them; refused naming the ops otherwise."""
    waits = wait_ops()
    in_flight: dict[str, Op] = {}
    for op in p.ops:
        if op.type in waits and not any(x in in_flight for x in op.inputs):
            raise InFlightError(f"{fmt_op(op)} waits for no collective in flight (none has overlap=1)")
        early = [x for x in op.inputs if x in in_flight]
        if early:
            start = in_flight[early[0]]
            if op.type == _wait_of(start) and list(op.inputs) == list(start.outputs):
                for x in start.outputs:
                    del in_flight[x]
                continue
            raise InFlightError(
                f"{fmt_op(op)} reads {early[0]!r} before the wait of the collective in flight that "
                f"makes it: {fmt_op(start)}"
            )
        if op.attrs.get("overlap") and _wait_of(op) is not None:
            in_flight.update((x, op) for x in op.outputs)
    if in_flight:
        left = next(iter(in_flight.values()))
        raise InFlightError(f"a collective left in flight is never waited for: {fmt_op(left)}")


def _wait_of(op: Op) -> str | None:
    row = registry.get(op.type)
    return None if row is None else row.wait_op

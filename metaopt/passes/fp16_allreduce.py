"""fp16_allreduce (Fleet's ``strategy.fp16_allreduce``): data parallel's float32 grads travel
in float16, half the bytes on the wire.

    plan = plan_fp16_allreduce(program, reduced=["fc1.weight@GRAD@REDUCED", ...])
    program = apply_fp16_allreduce(program, plan)

Each all-reduce that makes one of `reduced` (data parallel's buckets) gets
``comm_dtype=float16``::

    w@GRAD@REDUCED, b@GRAD@REDUCED = AllReduce(w@GRAD, b@GRAD, reduce=avg, comm_dtype=float16)  # role=comm

The kernel divides each bucket by the worker count in float32, casts it, sums it over the
workers in float16 and casts the sum back (torch's fp16 compress hook): the update reads
float32 grads with float16's precision (about 3 decimal digits). A bucket of float16 or
bfloat16 grads (AMP O2) is narrow already and is skipped, said in the plan. Pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metaopt.ir import Program
from metaopt.passes.driver import plan_text

COMM_DTYPE = "float16"


class Fp16AllReduceError(ValueError):
    pass


@dataclass
class Fp16AllReducePlan:
    ops: list[int] = field(default_factory=list)  # the all-reduce ops whose buckets travel in float16
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (reduced grad, why not)

    def __str__(self) -> str:
        head = f"fp16_allreduce: {len(self.ops)} all-reduce op(s) send float16"
        return plan_text(head, skipped=self.skipped)


def plan_fp16_allreduce(p: Program, *, reduced: list[str]) -> Fp16AllReducePlan:
    """Which of the ops making `reduced` (data parallel's reduced grads) send float16."""
    producers = p.producers()
    plan = Fp16AllReducePlan()
    for g in reduced:
        at = producers.get(g)
        if at is None:
            raise Fp16AllReduceError(f"fp16_allreduce: no op of {p.name!r} makes {g!r}")
        op = p.ops[at]
        if "comm_dtype" not in _params(op.type):
            raise Fp16AllReduceError(f"fp16_allreduce: {g!r} is made by {op.type}, which sends its own dtype")
        if p.vars[g].dtype != "float32":
            plan.skipped.append((g, f"{p.vars[g].dtype} already"))
        elif at not in plan.ops:
            plan.ops.append(at)
    plan.ops.sort()
    return plan


def apply_fp16_allreduce(p: Program, plan: Fp16AllReducePlan) -> Program:
    """A clone of `p` whose planned all-reduces send float16."""
    q = p.clone()
    chosen = set(plan.ops)
    q.ops = [
        dataclasses.replace(op, attrs={**op.attrs, "comm_dtype": COMM_DTYPE}) if i in chosen else op
        for i, op in enumerate(q.ops)
    ]
    return q


def _params(op_type: str) -> set[str]:
    """The attrs the op's kernel takes (its row's signature)."""
    import inspect

    from metaopt.ops import registry

    row = registry.get(op_type)
    return set() if row is None else set(inspect.signature(row.kernel).parameters)

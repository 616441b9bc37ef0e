"""Recompute partition (Paddle's ``recompute_partition``): a recompute checkpoint that every
rank of the model-parallel group holds whole is held as this rank's 1/mp slice instead.

    plan = plan_recompute_partition(program, checkpoints=plan.checkpoints, mp_degree=2,
                                    group="model_parallel", split=tp_plan.sharded)
    print(plan)                 # which checkpoints are sliced, which skipped and why
    program = recompute_partition(program, plan=plan)          # after `recompute`

* Right after the op producing a partitioned checkpoint ``x``:
  ``x@MP_SLICE = PartitionSlice(x)`` (role ``partition``, origin ``x``): ``x`` flattened,
  zero-padded to a multiple of mp, this rank's contiguous chunk, copied. The forward's own
  readers keep reading ``x``; nothing after the forward does, so the executor frees ``x``
  after its last forward reader and only the slice is held until the backward.
* Right before the first op after the forward that reads ``x`` (the first op of the
  recompute of the segment ``x`` opens, or a grad op reading ``x`` itself):
  ``x@MP_GATHERED = PartitionGather(x@MP_SLICE)`` (role ``recompute``, origin ``x``) all-gathers
  the slices over the group, and every op after the forward reads ``x@MP_GATHERED``. The
  gathered value is ``x`` bit for bit, so the training is bit-identical to recompute alone.
* What is partitioned: checkpoints that open a recomputed segment (every one but the last:
  the ops after the last are not recomputed, so, as in Paddle, whose partition slices the
  inputs of recomputed layers only, it is kept whole) and that are replicated over the group.
  A checkpoint tensor parallel split already (each rank holds its own 1/mp of it: `split`),
  one the backward never reads, a program output, or one whose size cannot be put back from
  the gathered length (more than one dim known only at run time, or fewer than mp elements
  besides that dim) is skipped, with the reason in the plan.
* Offload runs after this pass: it is handed the slices (`PartitionPlan.slices`) as the vars
  to move, so only the slice goes to host memory and back, and the gather reads the copy
  fetched back.
* With a pipeline the plan needs no cuts: it runs on the whole program before the split, and
  the pipeline split (passes/pipeline.py `_place_partition`) puts each checkpoint's slice, its
  host copies and its gather in the stage(s) whose backward reads the gathered value. A
  checkpoint sent across a cut is thus sliced by the stage that received it (and holds it for
  its recompute), as Paddle slices each recomputed layer's input wherever the layer runs; the
  stage that made it only sends it. (Skipping such checkpoints instead would keep whole the
  input of every later stage's first recomputed segment, with nothing gained in simplicity.)

Why this is sound: every rank of the group runs the same program (fleet's minimize checks
that the workers' printed programs agree), so the ranks reach each gather in the same order,
as they reach TPReduce; and each slice var's declared shape is its 1/mp length, so
`estimate_memory` and the memory report count 1/mp of each partitioned checkpoint's bytes.
The pass is pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from metaopt.ir import Op, Program, Var, did_you_mean, names, roles
from metaopt.ir.printer import fmt_op
from metaopt.passes.driver import plan_text


class RecomputePartitionError(ValueError):
    pass


@dataclass(frozen=True)
class Partitioned:
    checkpoint: str
    slice: str  # the var holding this rank's 1/mp slice from the forward to the gather
    gathered: str  # the checkpoint put back together, read by everything after the forward
    slice_shape: tuple  # (elements,): the checkpoint's numel / mp, rounded up
    gather_shape: list[int]  # the checkpoint's shape, -1 for its one dim known at run time
    gather_before: int  # index of the op (in the planned program) the gather goes before


@dataclass
class PartitionPlan:
    mp_degree: int
    group: list[int] | str
    partitioned: list[Partitioned] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint, why)
    gather_lines: list[str] = field(default_factory=list, repr=False)  # the op each gather precedes

    @property
    def slices(self) -> dict[str, str]:
        """checkpoint -> the var holding its slice after the forward (what offload moves)."""
        return {c.checkpoint: c.slice for c in self.partitioned}

    def __str__(self) -> str:
        return plan_text(
            f"recompute partition: {len(self.partitioned)} checkpoint(s) held as 1/{self.mp_degree} "
            f"slices over the model-parallel group ({self.group})",
            [
                f"{c.checkpoint}: {c.slice} {list(c.slice_shape)}, gathered before `{where.strip()}`"
                for c, where in zip(self.partitioned, self.gather_lines, strict=True)
            ],
            self.skipped,
        )


def plan_recompute_partition(
    p: Program,
    *,
    checkpoints: list[str],
    mp_degree: int,
    group: list[int] | str,
    split: Iterable[str] = (),
) -> PartitionPlan:
    """Which checkpoints of recomputed program `p` are held as slices, where each is gathered,
    and why the others are not (module doc). `split`: the activations tensor parallel split
    over the group (each rank holds its own part already)."""
    if mp_degree < 2:
        raise RecomputePartitionError(
            f"recompute partition slices checkpoints over the model-parallel group: mp_degree={mp_degree} "
            "has nothing to slice over (it needs tensor parallel with mp_degree > 1)"
        )
    if not isinstance(group, str) and len(group) != mp_degree:
        raise RecomputePartitionError(
            f"group {group} must list the {mp_degree} ranks of the model-parallel group"
        )
    for c in checkpoints:
        if c not in p.vars:
            raise RecomputePartitionError(
                f"checkpoint {c!r} is not a var of {p.name!r}{did_you_mean(c, p.vars)}"
            )
    first_after = next((i for i, op in enumerate(p.ops) if roles.after_forward(op.role)), None)
    if first_after is None:
        raise RecomputePartitionError(
            f"program {p.name!r} has no backward: recompute partition rewrites a recomputed training program"
        )
    prod = {o: i for i, op in enumerate(p.ops[:first_after]) for o in op.outputs if o}
    split = set(split)
    plan = PartitionPlan(mp_degree, group if isinstance(group, str) else list(group))
    made = [c for c in checkpoints if c in prod]
    last = max(made, key=lambda c: prod[c], default=None)
    taken = set(p.vars)
    for c in sorted(dict.fromkeys(checkpoints), key=lambda c: prod.get(c, -1)):
        first_use = next((i for i in range(first_after, len(p.ops)) if c in p.ops[i].inputs), None)
        why = _skip_reason(p, c, prod, split, first_use, last, mp_degree)
        if why is not None:
            plan.skipped.append((c, why))
            continue
        v = p.vars[c]
        slice_name = names.fresh(names.mp_slice(c), taken)
        gathered = names.fresh(names.mp_gathered(c), taken | {slice_name})
        taken |= {slice_name, gathered}
        plan.partitioned.append(
            Partitioned(
                c, slice_name, gathered, (_slice_dim(v.shape, mp_degree),), _gather_shape(v.shape), first_use
            )
        )
        plan.gather_lines.append(fmt_op(p.ops[first_use]))
    return plan


def _skip_reason(
    p: Program,
    c: str,
    prod: dict[str, int],
    split: set[str],
    first_use: int | None,
    last: str | None,
    mp: int,
) -> str | None:
    """Why checkpoint `c` is not partitioned; None: it is."""
    if c not in prod:
        return "not computed by the forward (a param, input or constant): nothing to free"
    if c in split:
        return (
            "split over the model-parallel group by tensor parallel already: each rank holds only its own "
            "1/mp of it"
        )
    if first_use is None:
        return "the backward never reads it: nothing is held for it"
    if c == last:
        return (
            "the last checkpoint opens no recomputed segment (the ops after it are not recomputed): "
            "kept whole, as Paddle partitions only the inputs of recomputed layers"
        )
    if c in p.outputs or c == p.loss_name:
        return "a program output: kept whole for the fetch"
    shape = p.vars[c].shape
    if shape is None:
        return "its shape is not known: the gathered slices could not be put back in it"
    runtime = [d for d in shape if not isinstance(d, int)]
    if len(runtime) > 1:
        return (
            f"shape {list(shape)} has more than one dim known only at run time: the gather could not "
            "restore it"
        )
    known = math.prod(d for d in shape if isinstance(d, int))
    if runtime and known < mp:
        return (
            f"shape {list(shape)}: fewer than mp_degree={mp} elements besides its run-time dim, so the "
            "gathered length would not say that dim (and the slice saves almost nothing)"
        )
    return None


def _slice_dim(shape: tuple, mp: int) -> int | str:
    """The slice's length, ceil(numel / mp), as a dim: an int, or an expression of the one
    run-time dim (``"256*batch"``, ``"(15*batch+1)//2"``) that `eval_dim` evaluates."""
    known = math.prod(d for d in shape if isinstance(d, int))
    runtime = [d for d in shape if not isinstance(d, int)]
    if not runtime:
        return -(-known // mp)
    d = runtime[0] if runtime[0].isidentifier() else f"({runtime[0]})"
    if known % mp == 0:
        return d if known == mp else f"{known // mp}*{d}"
    return f"({known}*{d}+{mp - 1})//{mp}"


def _gather_shape(shape: tuple) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape]


def recompute_partition(p: Program, *, plan: PartitionPlan) -> Program:
    """A copy of `p` with `plan`'s checkpoints sliced after they are made and gathered before
    their first use after the forward (module doc); `plan` must be `p`'s."""
    q = p.clone()
    if not plan.partitioned:
        return q
    attrs = {"group": plan.group, "parts": plan.mp_degree}
    after_producer: dict[str, Partitioned] = {}
    before: dict[int, list[Partitioned]] = {}
    for c in plan.partitioned:
        v = q.vars[c.checkpoint]
        if c.slice in q.vars or c.gathered in q.vars:
            raise RecomputePartitionError(
                f"{c.slice!r} or {c.gathered!r} exists in {p.name!r}: not this program's plan"
            )
        q.add_var(Var(c.slice, v.dtype, c.slice_shape))
        q.add_var(Var(c.gathered, v.dtype, v.shape))
        after_producer[c.checkpoint] = c
        before.setdefault(c.gather_before, []).append(c)
    first_after = next(i for i, op in enumerate(q.ops) if roles.after_forward(op.role))
    gathered = {c.checkpoint: c.gathered for c in plan.partitioned}
    scope: dict[str, str] = {}  # checkpoint -> its producer's scope (the gather's too)
    ops: list[Op] = []
    for i, op in enumerate(q.ops):
        for c in before.get(i, ()):
            ops.append(
                Op(
                    "PartitionGather",
                    [c.slice],
                    [c.gathered],
                    {**attrs, "shape": list(c.gather_shape)},
                    role="recompute",
                    scope=scope.get(c.checkpoint, op.scope),
                    origin=c.checkpoint,
                )
            )
        if i >= first_after:
            op.inputs = [gathered.get(x, x) for x in op.inputs]
        ops.append(op)
        for o in op.outputs:
            c = after_producer.get(o)
            if c is not None:
                scope[o] = op.scope
                ops.append(
                    Op(
                        "PartitionSlice",
                        [o],
                        [c.slice],
                        dict(attrs),
                        role="partition",
                        scope=op.scope,
                        origin=o,
                    )
                )
    q.ops = ops
    return q

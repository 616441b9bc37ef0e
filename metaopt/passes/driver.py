"""One driver for a rewrite made of steps: plan, rewrite, verify, dump, log, in list order.

A `Step` is ``Step(name, enabled, rewrite, plan=, check=, doc=, meta=, reads=, writes=)``:

* ``enabled(ctx) -> (bool, reason)``: whether it runs for this strategy and worker, and why
  (the reason is printed for skipped steps too);
* ``check(ctx)``: refuses what the step cannot do (a missing process group, a bad config)
  before ANY step rewrites anything;
* ``plan(program, ctx) -> plan | None``: computed once, printable, kept in ``ctx.plans``;
* ``rewrite(program, plan, ctx) -> Program | list[Program]``: a pure pass given that plan;
  a list is a split (the pipeline's stage programs): the steps after it rewrite every
  part, and ``ctx.part`` says which one is this worker's.

A pass with a plan reads nothing but the plan: ``apply_<pass>(program, plan)`` (or
``<pass>(program, plan=plan)`` where the pass has no one-call form). Its config goes into
``plan_<pass>(program, **config)``; the one-call form ``<pass>(program, **config)`` is
exactly ``apply_<pass>(program, plan_<pass>(program, **config))``. No pass takes both.

`run_steps` verifies the program after every step, so a step that breaks an invariant is
named where it did (`StepError`, with the verifier's error as its cause), writes it under
``METAOPT_DUMP`` and logs the plan. The steps hand each other what they made through
the context (`Context`): no step finds another's vars by rebuilding their names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaopt.dump import dump
from metaopt.ir import Program, verify
from metaopt.progress import timed

logger = logging.getLogger("metaopt.passes")


class StepError(RuntimeError):
    """A step left a program that breaks an IR invariant (the cause says which)."""


@dataclass
class Run:
    """What the driver keeps of a run of steps, whatever the steps are for: each step's plan,
    the parts after a split and which part is this worker's."""

    plans: dict[str, Any] = field(default_factory=dict)  # step name -> its plan (for the caller)
    parts: list[Program] = field(default_factory=list)  # after a split: every part
    part: int = 0  # after a split: this worker's part


@dataclass
class Context(Run):
    """What the steps of a training rewrite hand each other.

    The caller fills `INPUTS`; the driver owns `plans`, `parts` and `part`; each step writes
    the fields its row declares (`Step.writes`) and reads only what its row declares
    (`Step.reads`), which `check_declarations` holds to the order of the steps.
    """

    strategy: Any = None  # fleet.DistributedStrategy (or any object the steps read)
    optimizer: Any = None  # a metaopt.optimizer.Optimizer: its update ops
    world_size: int = 1
    rank: int = 0
    parameter_list: list[str] | None = None
    no_grad_set: set[str] | None = None
    loss: str = ""  # the var the backward starts from (the scaled loss under loss scaling)
    loss_scaling: bool = False  # set by the amp steps' config
    params_grads: list[tuple[str, str]] = field(default_factory=list)  # (param, grad the backward made)
    loss_grad: str | None = None  # the backward's seed: d(loss)/d(loss)
    tied: dict[str, str] = field(default_factory=dict)  # param dropped -> the param it reads instead
    checkpoints: list[str] = field(default_factory=list)  # recompute's, after resolution
    tp_plan: Any = None  # tensor parallel's plan: split params, sharded values, the mp degree
    sp_plan: Any = None  # sequence parallel's plan (beside tensor parallel): the sequence-split values
    sep_plan: Any = None  # segment parallel's plan: the values on the local sequence, the exchanges
    ep_plan: Any = None  # expert parallel's plan: the expert params cut to this worker's experts
    dp_plan: Any = None  # data parallel's plan: its buckets of grads (what fp16_allreduce narrows)
    partition_slices: dict[str, str] = field(default_factory=dict)  # checkpoint -> its 1/mp slice var
    memory_report: Any = None  # recompute's predicted effect (recompute.MemoryReport), kept current
    reports: bool = True  # False: no memory report made (the planner estimates the whole step itself)
    optimize_ops: list = field(default_factory=list)  # the update ops apply_optimizer made (Op objects)

    @property
    def grads(self) -> dict[str, str]:
        return dict(self.params_grads)


Enabled = Callable[[Any], tuple[bool, str]]  # of the run's context (a Run: Context for training)
Rewrite = Callable[[Program, Any, Any], "Program | list[Program]"]


def _no_check(ctx: Run) -> None:
    return None


def _no_plan(program: Program, ctx: Run) -> None:
    return None


@dataclass(frozen=True)
class Step:
    name: str
    enabled: Enabled
    rewrite: Rewrite
    plan: Callable[[Program, Any], Any] = _no_plan
    check: Callable[[Any], None] = _no_check
    doc: str = ""  # one line: what the step does (printed in the plan)
    meta: str = ""  # Fleet's name of the meta optimizer it belongs to (``applied_meta_list``)
    reads: tuple[str, ...] = ()  # Context fields it reads (beside the caller's `INPUTS`)
    writes: tuple[str, ...] = ()  # Context fields it writes for the steps after it


@dataclass
class StepRow:
    name: str
    runs: bool
    reason: str
    doc: str
    meta: str = ""


# Context fields the caller fills before the first step; `plans`, `parts` and `part` are the
# driver's (a split step sets `part`).
INPUTS = frozenset(
    {
        "strategy",
        "optimizer",
        "world_size",
        "rank",
        "parameter_list",
        "no_grad_set",
        "loss",
        "loss_scaling",
        "reports",
    }
)
_DRIVER = frozenset({"plans", "parts"})


class PartPlans(dict):
    """Part index -> that part's own plan: for a step after a split whose plan depends on the part
    (the pipeline's cut of each stage program), made for every part at once and printed together."""

    @classmethod
    def of(cls, plan: Callable[[Program], Any], parts: Sequence[Program]) -> PartPlans:
        return cls({k: plan(q) for k, q in enumerate(parts)})

    def of_part(self, p: Program, parts: Sequence[Program]) -> Any:
        """The plan of part `p`, one of `parts` (the driver hands each rewrite the part itself)."""
        return self[next(k for k, q in enumerate(parts) if q is p)]

    def __str__(self) -> str:
        return "\n".join(str(self[k]) for k in sorted(self))


def check_declarations(
    steps: Sequence[Step], context: type[Run] = Context, inputs: frozenset[str] = INPUTS
) -> None:
    """Each step reads only fields of `context` the caller gives (`inputs`) or an earlier step
    writes, and declares only fields `context` has: raises StepError naming the step and the
    field. A step list is checked where it is defined (at import), whatever a run enables."""
    fields = {f.name for f in dataclasses.fields(context)}
    written = set(inputs)
    for s in steps:
        unknown = sorted((set(s.reads) | set(s.writes)) - fields)
        if unknown:
            raise StepError(f"step {s.name!r} declares {unknown}, which the Context does not have")
        owned = sorted(set(s.writes) & _DRIVER)
        if owned:
            raise StepError(f"step {s.name!r} writes {owned}, which the driver owns")
        missing = sorted(set(s.reads) - written - set(s.writes))  # its own: read back or grown
        if missing:
            raise StepError(f"step {s.name!r} reads {missing}, which no earlier step writes")
        written |= set(s.writes)


def plan_text(head: str, items: Iterable[str] = (), skipped: Iterable[tuple[str, str]] = ()) -> str:
    """A plan as every pass prints it (the log, ``METAOPT_DUMP``, the golden files): its head line,
    a line per item, then a line per candidate it skipped with why; one writer so that all plans
    read alike."""
    lines = [head, *(f"  {item}" for item in items)]
    lines += [f"  skipped {name}: {why}" for name, why in skipped]
    return "\n".join(lines)


def plan_rows(steps: Sequence[Step], ctx: Context) -> list[StepRow]:
    """Which steps run for `ctx`, in list order, each with its reason."""
    rows = []
    for s in steps:
        runs, reason = s.enabled(ctx)
        rows.append(StepRow(s.name, runs, reason, s.doc, s.meta))
    return rows


def refusals(steps: Sequence[Step], ctx: Context) -> list[Exception]:
    """What the enabled steps refuse, in list order: each ``check``'s error (it raises the one
    thing it refuses). The caller raises the first before any step runs (fleet's TrainPlan
    lists them with the strategy's own)."""
    out: list[Exception] = []
    for s in steps:
        if s.enabled(ctx)[0]:
            try:
                s.check(ctx)
            except Exception as e:  # noqa: BLE001 - a refusal, of whatever type the check chose
                out.append(e)
    return out


def verified(program: Program, step: str, where: str = "") -> Program:
    """`program`, verified: an invariant it breaks is a StepError naming `step` (the pass that
    made it) and `where` (a part of a split), the verifier's error as its cause."""
    try:
        verify(program)
    except ValueError as e:
        raise StepError(f"step {step!r} broke an invariant of {program.name!r}{where}: {e}") from e
    return program


def run_steps(
    program: Program,
    steps: Sequence[Step],
    ctx: Run,
    *,
    owned: bool = False,
    verify_each: bool = True,
    label: str = "minimize",
) -> Program:
    """Run the enabled `steps` on a copy of `program`; returns this worker's result.

    `program` itself is never changed (the caller replaces it once, at the end), unless it is
    `owned`: a program the caller made for this run alone (the importer's), rewritten without a
    copy, each program a step replaced given up at once. The caller has checked the steps
    first (`refusals`: once), so a refused configuration changes nothing. With
    `verify_each=False` (a very large import) the result is verified once, after the last step.
    Each step's seconds are logged at INFO as "<label> step <name>".
    """
    enabled = [s for s in steps if s.enabled(ctx)[0]]
    ctx.parts = [program if owned else program.clone()]
    ctx.part = 0
    for s in enabled:
        with timed(logger, f"{label} step {s.name}"):
            before = ctx.parts
            _run_step(s, ctx, verify_each)
            if owned:
                _drop([q for q in before if all(q is not r for r in ctx.parts)])
    if not verify_each:
        for k, q in enumerate(ctx.parts):
            verified(
                q, enabled[-1].name if enabled else "(none)", f" (part {k})" if len(ctx.parts) > 1 else ""
            )
    return ctx.parts[ctx.part]


def _drop(programs: list[Program]) -> None:
    """Let programs a step replaced go at once: their vars point back at them (`Var.program`),
    a cycle only the garbage collector frees, which a bulk import pauses (100k ops: 2M objects
    piled up, then 0.7 s to collect)."""
    for q in programs:
        q.vars = {}


def _run_step(s: Step, ctx: Run, verify_each: bool = True) -> None:
    """One step of `run_steps`: plan, rewrite (every part after a split), verify, dump."""
    current = ctx.parts[ctx.part]
    plan = s.plan(current, ctx)
    if plan is not None:
        ctx.plans[s.name] = plan
        logger.info("%s", plan)
    if len(ctx.parts) == 1:
        out = s.rewrite(current, plan, ctx)
        parts = out if isinstance(out, list) else [out]  # a split sets ctx.part itself
    else:  # after a split: the step rewrites every part alike
        parts = []
        for k, q in enumerate(ctx.parts):
            out = s.rewrite(q, plan, ctx)
            if isinstance(out, list):
                raise StepError(f"step {s.name!r} splits a program that is already split (part {k})")
            parts.append(out)
    if verify_each:
        for k, q in enumerate(parts):
            verified(q, s.name, f" (part {k})" if len(parts) > 1 else "")
    ctx.parts = parts
    dump(ctx.parts[ctx.part], s.name)

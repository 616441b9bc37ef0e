"""fleet.distributed_optimizer: the strategy's training rewrite around the user's optimizer.

``minimize(loss)`` runs THE list of steps, ``metaopt.fleet.steps.STEPS`` (its docstring gives
the order and why), with one driver (``metaopt.passes.driver.run_steps``): every enabled
step plans once, rewrites with a pure pass, is verified, dumped and logged; the user's
program is replaced once, at the end, so a refused configuration leaves it untouched.
``opt.plan()`` prints the steps in order, each with why it runs or is skipped, and what
would be refused.

Fleet features metaopt does not have (``UNSUPPORTED_FEATURES``: dgc, a_sync, ...),
strategy fields nothing implements yet (set to a non-default value) and combinations it
cannot honour (``CONFLICTS``) are refused before anything is rewritten — never silently
dropped. ``opt.applied_meta_list`` names, in Fleet's words, the meta optimizers that ran.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from metaopt.fleet import env
from metaopt.fleet.steps import (
    CONFLICTS,
    FLEET_META_OPTIMIZERS,
    STEPS,
    hybrid_errors,
    requirement_errors,
    warn_if_nothing_saved,
)
from metaopt.fleet.strategy import CONFIGS, UNSUPPORTED_FEATURES, DistributedStrategy
from metaopt.ir import Program, Var, print_program
from metaopt.passes.driver import Context, StepRow, plan_rows, refusals, run_steps

logger = logging.getLogger("metaopt.fleet")


@dataclass
class TrainPlan:
    """The steps ``minimize`` would run, in order, each with its reason; what it refuses."""

    rows: list[StepRow]
    optimizer: str
    errors: list[Exception] = field(default_factory=list)  # what minimize would refuse, in order
    warnings: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[str]:
        return [r.name for r in self.rows if r.runs]

    @property
    def applied(self) -> list[str]:
        """Fleet's names of the meta optimizers that run (``applied_meta_list``)."""
        used = {r.meta for r in self.rows if r.runs and r.meta}
        return [m for m in FLEET_META_OPTIMIZERS if m in used]

    def check(self) -> None:
        """Raise the first thing ``minimize`` refuses (unsupported feature, conflict)."""
        if self.errors:
            raise self.errors[0]

    def __str__(self) -> str:
        width = max(len(r.name) for r in self.rows)
        lines = [f"training rewrite (metaopt.fleet.steps.STEPS, in order; optimizer {self.optimizer}):"]
        for r in self.rows:
            lines.append(f"  {r.name:<{width}}  {'run ' if r.runs else 'skip'}  {r.reason}")
        lines += [f"  refused: {e}" for e in self.errors]
        lines += [f"  note: {w}" for w in self.warnings]
        return "\n".join(lines)


def _refusals(strategy: DistributedStrategy) -> list[Exception]:
    errors: list[Exception] = []
    for name, why in UNSUPPORTED_FEATURES.items():
        if getattr(strategy, name):
            errors.append(
                NotImplementedError(
                    f"strategy.{name}=True: Fleet's {name} is not implemented in metaopt ({why}); "
                    f"set strategy.{name} = False"
                )
            )
    unimplemented = getattr(strategy, "unimplemented", None)
    if unimplemented is not None:
        errors += unimplemented()
    errors += requirement_errors(strategy)
    errors += hybrid_errors(strategy)
    for flags, why in CONFLICTS:
        if all(getattr(strategy, f) for f in flags):
            both = " and ".join(f"strategy.{f}=True" for f in flags)
            errors.append(ValueError(f"{both} cannot be combined: {why}"))
    return errors


def _unused_configs(strategy: DistributedStrategy) -> list[str]:
    defaults = DistributedStrategy()
    out = []
    for flag in CONFIGS:
        cfg = f"{flag}_configs"
        if not getattr(strategy, flag) and getattr(strategy, cfg) != getattr(defaults, cfg):
            out.append(f"strategy.{cfg} is set but strategy.{flag}=False: the config is unused")
    return out


class DistributedOptimizer:
    """Fleet's distributed optimizer: ``minimize`` runs the training rewrite (`STEPS`) with
    `optimizer`'s updates and rewrites ``loss.program`` in place.

    ``loss_scaling`` (None: on for float16 AMP, off for bfloat16, as Paddle) forces AMP's
    loss scaling on or off."""

    def __init__(self, optimizer: Any, strategy: DistributedStrategy) -> None:
        self.user_defined_optimizer = optimizer
        # A copy, as in Fleet: changing the strategy afterwards does not change this optimizer.
        self.user_defined_strategy = strategy.copy()
        self.applied_meta_list: list[str] = []
        self.loss_scaling: bool | None = None
        # False: minimize makes no `memory_report` (recompute's two estimates of the whole program)
        # and warns of nothing it would say; the planner, which estimates every rewrite itself
        self.memory_reports = True
        self.context: Context | None = None  # what the last minimize's steps handed each other
        self.amp_plan = self.recompute_plan = self.memory_report = None
        self.data_parallel_plan = self.pipeline_plan = self.tensor_parallel_plan = None
        self.expert_parallel_plan = None
        self.sequence_parallel_plan = None
        self.segment_parallel_plan = self.context_parallel_plan = None
        self.partition_plan = None
        self.stage_programs: list[Program] = []

    @property
    def inner_opt(self) -> Any:
        return self.user_defined_optimizer

    def _context(self) -> Context:
        s = self.user_defined_strategy
        scaling = self.loss_scaling
        if scaling is None:
            scaling = s.amp_configs["dtype"] == "float16"
        return Context(
            strategy=s,
            optimizer=self.user_defined_optimizer,
            world_size=env.worker_num(),
            rank=env.worker_index(),
            loss_scaling=bool(scaling),
            reports=self.memory_reports,
        )

    def plan(self, loss: Var | None = None) -> TrainPlan:
        """What ``minimize`` would do (printable); needs ``fleet.init`` (data parallel reads
        the worker count). `loss` is accepted for Fleet-style calls and unused."""
        s = self.user_defined_strategy
        warnings = _unused_configs(s)
        for w in warnings:
            logger.warning(w)
        name = type(self.user_defined_optimizer).__name__
        ctx = self._context()
        rows = plan_rows(STEPS, ctx)
        # one list, one place: the strategy's own refusals, then each enabled step's check
        errors = _refusals(s) or refusals(STEPS, ctx)  # the steps' only for a strategy fleet accepts
        unique = list({str(e): e for e in errors}.values())  # two steps may share one check
        return TrainPlan(rows, name, unique, warnings)

    def minimize(
        self,
        loss: Var,
        startup_program: Any = None,
        parameter_list: Any = None,
        no_grad_set: Any = None,
    ) -> tuple[Any, Any]:
        """Rewrite ``loss.program`` in place into a training program; (optimize_ops, params_grads).

        Everything refused is refused before the program is touched. ``params_grads`` pairs
        each param of the resulting program with the grad its update reads (the reduced,
        unscaled one where data parallel and AMP apply), by name.
        """
        if not isinstance(loss, Var):
            raise TypeError(f"minimize: loss must be a Var of a Program, got {type(loss).__name__}")
        if loss.program is None:
            raise ValueError(f"minimize: loss {loss.name!r} belongs to no program (use program.loss)")
        from metaopt.passes.minimize import check_forward_only

        check_forward_only(loss.program, "fleet minimize")
        plan = self.plan(loss)
        plan.check()  # every refusal, the steps' checks included, before anything is touched
        ctx = self._context()
        ctx.loss = loss.name
        ctx.parameter_list = _names(parameter_list)
        ctx.no_grad_set = set(_names(no_grad_set) or ()) or None
        opt = self.user_defined_optimizer
        if not _is_metaopt_optimizer(opt):
            rewriting = [s for s in plan.steps if s not in ("append_backward", "apply_optimizer")]
            if rewriting:
                raise TypeError(
                    f"steps {rewriting} rewrite the optimizer's update ops: they need a "
                    f"metaopt.optimizer optimizer, got {type(opt).__name__}"
                )
            # nothing to rewrite: Fleet hands the whole minimize to the inner optimizer
            self.applied_meta_list = []
            logger.info("applied meta optimizers: []")
            return opt.minimize(loss, startup_program, parameter_list, no_grad_set)
        program = loss.program
        # before any step: a step may run a collective (stage 3's initial broadcast), which a
        # worker with another strategy would never join (it waited out METAOPT_COMM_TIMEOUT)
        _check_strategies_agree(ctx, self.user_defined_strategy)
        final = run_steps(program, STEPS, ctx)
        _check_workers_agree(ctx)  # before the program is replaced, and before any collective runs
        self.context = ctx
        self._keep_reports(ctx)
        program.replace_with(final)
        self.applied_meta_list = plan.applied
        logger.info("training rewrite: %s; applied meta optimizers: %s", plan.steps, self.applied_meta_list)
        warn_if_nothing_saved(ctx)
        optimize_ops = [op for op in program.ops if op.role == "optimize"]
        return optimize_ops, _params_grads(program, ctx.params_grads, ctx.tied)

    def _keep_reports(self, ctx: Context) -> None:
        """Fleet users read ``opt.<report>``: the plans of the steps that ran."""
        self.amp_plan = ctx.plans.get("amp_casts")
        self.recompute_plan = ctx.plans.get("recompute")
        self.data_parallel_plan = ctx.plans.get("data_parallel")
        self.tensor_parallel_plan = ctx.plans.get("tensor_parallel")
        self.expert_parallel_plan = ctx.plans.get("expert_parallel")
        self.sequence_parallel_plan = ctx.sp_plan  # made by the tensor_parallel step, after its rewrite
        ring = ctx.sep_plan is not None and ctx.sep_plan.ring  # the sequence axis runs context parallel
        self.segment_parallel_plan = None if ring else ctx.sep_plan
        self.context_parallel_plan = ctx.sep_plan if ring else None
        self.partition_plan = ctx.plans.get("partition")  # recompute partition: what is sliced, why not
        self.pipeline_plan = ctx.plans.get("pipeline_split")
        self.memory_report = ctx.memory_report
        self.stage_programs = list(ctx.parts) if self.pipeline_plan is not None else []


# --- every worker holds the same program ------------------------------------------------------


def _check_workers_agree(ctx: Context) -> None:
    """With several workers, raise ``env.WorkersDisagreeError`` on every worker unless all
    rewrote the same program, naming the first var or op that differs.

    Workers that build different programs (another hidden size, an extra layer, another
    strategy) would otherwise meet in collectives of different sizes, and gloo aborts the
    process in C++ with no name. Compared: every part the rewrite made (data parallel: the one
    training program; a pipeline: every stage's program, which every worker builds), printed
    line by line as ``print(program)`` shows them, less the program's name (labels, not
    semantics). Param values are not compared (rank 0's are broadcast at the first run), nor
    constants of more than ``printer.INLINE_VALUES`` elements (the printed text omits them).
    Skipped without a process group (a single process inspecting a multi-worker rewrite; data
    parallel has refused that already)."""
    import torch.distributed as dist

    if ctx.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    env.check_workers_agree(
        _program_lines(ctx.parts),
        "fleet minimize: the workers' training programs",
        ". Every worker must build the same program: the same model and config, exported alike, "
        "and the same strategy (only the data may differ)",
    )


def _check_strategies_agree(ctx: Context, strategy: Any) -> None:
    """With several workers, raise ``env.WorkersDisagreeError`` on every worker unless all were
    given the same strategy (its printed overview, line by line), naming the first line that
    differs: the training programs are compared only after the rewrite, whose steps may already
    run collectives."""
    import torch.distributed as dist

    if ctx.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    lines = [(_strategy_label(line), line) for line in str(strategy).splitlines()]
    env.check_workers_agree(
        lines,
        "fleet minimize: the workers' strategies",
        ". Every worker must minimize with the same DistributedStrategy",
    )


def _strategy_label(line: str) -> str:
    words = line.strip(" |+=-\n").split()
    return f"the strategy's line {words[0]!r}" if words else "a rule of the strategy's table"


def _program_lines(parts: list[Program]) -> list[tuple[str, str]]:
    """(label, printed line) of every line of every part but its first (the program's name)."""
    out: list[tuple[str, str]] = []
    for k, p in enumerate(parts):
        where = f"stage {k}'s " if len(parts) > 1 else ""
        labels = _labels(p)
        for line in print_program(p).splitlines()[1:]:
            label = labels(line)
            out.append((f"{where}{label}", line))
    return out


def _labels(p: Program):
    """A function from each printed line of `p` (in order) to what it is: "var 'x'",
    "op 12 (Gemm -> 'h')", "module 'fc1'", "the program's inputs" ..."""
    items = {
        "vars:": iter(f"var {n!r}" for n in p.vars),
        "modules:": iter(f"module {m!r}" for m in p.modules),
        "updates:": iter(f"the update of {t!r}" for t in p.updates),
        "ops:": iter(f"op {i} ({op.type} -> {(op.outputs or [''])[0]!r})" for i, op in enumerate(p.ops)),
    }
    section: list = [None]

    def label(line: str) -> str:
        if line in items:
            section[0] = items[line]
            return f"the program's {line[:-1]} section"
        if section[0] is None:  # the header: inputs, outputs, loss, pipeline, gradient_merge
            return f"the program's {line.split(':', 1)[0]}"
        return next(section[0], "a line")

    return label


def _is_metaopt_optimizer(opt: Any) -> bool:
    from metaopt.optimizer import Optimizer

    return isinstance(opt, Optimizer)


def _names(xs: Any) -> list[str] | None:
    if xs is None:
        return None
    return [x.name if isinstance(x, Var) else x for x in xs]


def _params_grads(p: Program, pairs: list[tuple[str, str]], tied: dict[str, str]) -> list[tuple[str, str]]:
    """(param, the grad its update reads) for the params this program updates."""
    from metaopt.ops import registry

    reads: dict[str, str] = {}
    for op in p.ops:  # an update op reads (param, grad, lr, ...)
        if registry.is_update(op.type) and op.origin is not None and len(op.inputs) > 1:
            reads[op.origin] = op.inputs[1]
    out = []
    for param, _ in pairs:
        param = tied.get(param, param)
        if param in reads and param in p.vars:
            out.append((param, reads[param]))
    return out


def distributed_optimizer(
    optimizer: Any, strategy: DistributedStrategy | None = None
) -> DistributedOptimizer:
    """Fleet's ``fleet.distributed_optimizer``: `optimizer` with `strategy`'s training rewrite.

    Without `strategy`, the one given to ``fleet.init`` is used (else the defaults); a
    `strategy` given here wins over ``fleet.init``'s, as in Fleet 2.x.
    """
    if not callable(getattr(optimizer, "minimize", None)):
        raise TypeError(
            f"distributed_optimizer: expected an optimizer with minimize(), got {type(optimizer).__name__}"
        )
    if strategy is not None and not isinstance(strategy, DistributedStrategy):
        raise TypeError(
            f"distributed_optimizer: strategy must be a DistributedStrategy, got {type(strategy).__name__}"
        )
    from_init = env.user_strategy()
    if strategy is None:
        strategy = from_init if from_init is not None else DistributedStrategy()
    elif from_init is not None and from_init != strategy:
        logger.warning(
            "fleet.distributed_optimizer: the strategy given here overrides the one given to fleet.init"
        )
    return DistributedOptimizer(optimizer, strategy)

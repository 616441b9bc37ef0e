"""fleet.distributed_optimizer: the strategy's meta optimizers around the user's optimizer.

The meta optimizers and their order are ONE literal list, ``META_OPTIMIZERS``:

    amp, pipeline, recompute (+offload), gradient_merge, data_parallel, then the inner optimizer

Each entry is ``(name, strategy field, apply)``. ``apply(inner, strategy)`` wraps an
optimizer-like object (anything with Fleet's ``minimize(loss, startup_program,
parameter_list, no_grad_set) -> (optimize_ops, params_grads)``) and returns another, as
Fleet's meta optimizers wrap their ``inner_opt``. The chain is built from the inside
out, so the first entry is the outermost wrapper and its ``minimize`` runs first::

    amp( pipeline( recompute( gradient_merge( data_parallel( Adam ) ) ) ) ).minimize(loss)

The pipeline wraps recompute (unlike Fleet, whose recompute wraps the pipeline): it splits
the finished single-process program, so every recompute and offload op goes to the stage
of the forward var it stems from, and checkpoints are named for the whole model.

``data_parallel`` has no strategy field: it applies when ``fleet.worker_num() > 1`` (and
pipeline is off: a pipeline replicates itself over ``pipeline_configs.dp_degree``).
Offload is part of recompute (``recompute_configs.enable_offload``).

Implemented: amp (``fleet/amp_optimizer.py``), recompute (``fleet/recompute_optimizer.py``),
pipeline (``fleet/pipeline_optimizer.py``), data_parallel (``fleet/data_parallel_optimizer.py``).
Every other ``_apply_*`` below raises NotImplementedError naming the feature and its strategy field; an issue
that implements one replaces that function and nothing else. Fleet features metaopt does not have
(``UNSUPPORTED_FEATURES``: sharding, lamb, ...) and combinations it cannot honour
(``CONFLICTS``) are refused before anything is rewritten — never silently dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from metaopt.fleet import env
from metaopt.fleet.strategy import CONFIGS, UNSUPPORTED_FEATURES, DistributedStrategy
from metaopt.ir import Var

logger = logging.getLogger("metaopt.fleet")


class MetaOptimizer(NamedTuple):
    name: str
    field: str | None  # the strategy flag enabling it; None: data_parallel (worker_num() > 1)
    apply: Callable[[Any, DistributedStrategy], Any]  # (inner optimizer, strategy) -> optimizer


def _not_implemented(name: str, flag: str) -> NotImplementedError:
    return NotImplementedError(
        f"strategy.{flag}=True: the {name} meta optimizer is not implemented yet; set strategy.{flag} = False"
    )


def _apply_amp(inner: Any, strategy: DistributedStrategy) -> Any:
    """amp (``fleet/amp_optimizer.py``): casts, loss scaling, skipped overflow steps."""
    from metaopt.fleet.amp_optimizer import AmpOptimizer

    return AmpOptimizer(inner, strategy.amp_configs)


def _apply_recompute(inner: Any, strategy: DistributedStrategy) -> Any:
    """recompute (offload, ``recompute_configs['enable_offload']``, raises: not implemented yet)."""
    from metaopt.fleet.recompute_optimizer import RecomputeOptimizer

    return RecomputeOptimizer(inner, strategy.recompute_configs)


def _apply_pipeline(inner: Any, strategy: DistributedStrategy) -> Any:
    """One stage program per worker, micro-batches through a schedule (fleet/pipeline_optimizer.py)."""
    from metaopt.fleet.pipeline_optimizer import PipelineOptimizer

    return PipelineOptimizer(inner, strategy)


def _apply_gradient_merge(inner: Any, strategy: DistributedStrategy) -> Any:
    raise _not_implemented("gradient_merge", "gradient_merge")


def _apply_data_parallel(inner: Any, strategy: DistributedStrategy) -> Any:
    """Grads averaged over the workers by fused AllReduce ops; initial values from rank 0."""
    from metaopt.fleet.data_parallel_optimizer import DataParallelOptimizer

    return DataParallelOptimizer(inner, strategy)


# THE order (outermost first). Changing it changes what every program becomes.
META_OPTIMIZERS: tuple[MetaOptimizer, ...] = (
    MetaOptimizer("amp", "amp", _apply_amp),
    MetaOptimizer("pipeline", "pipeline", _apply_pipeline),
    MetaOptimizer("recompute", "recompute", _apply_recompute),
    MetaOptimizer("gradient_merge", "gradient_merge", _apply_gradient_merge),
    MetaOptimizer("data_parallel", None, _apply_data_parallel),
)

# Combinations refused, with the reason (every flag named in a conflict appears in the error).
CONFLICTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("pipeline", "gradient_merge"),
        "a pipeline already accumulates gradients over pipeline_configs['accumulate_steps'] "
        "micro-batches; use that instead of gradient_merge",
    ),
)


@dataclass
class PlanRow:
    name: str
    applies: bool
    reason: str


@dataclass
class MetaPlan:
    """Which meta optimizers ``minimize`` would apply and why the others are skipped."""

    rows: list[PlanRow]
    optimizer: str
    errors: list[Exception] = field(default_factory=list)  # what minimize would refuse, in order
    warnings: list[str] = field(default_factory=list)

    @property
    def applied(self) -> list[str]:
        return [r.name for r in self.rows if r.applies]

    def check(self) -> None:
        """Raise the first thing ``minimize`` refuses (unsupported feature, conflict)."""
        if self.errors:
            raise self.errors[0]

    def __str__(self) -> str:
        width = max(len(r.name) for r in self.rows)
        lines = ["meta optimizer plan (outermost first):"]
        for r in self.rows:
            lines.append(f"  {r.name:<{width}}  {'apply' if r.applies else 'skip '}  {r.reason}")
        lines.append(f"  {'optimizer':<{width}}  apply  {self.optimizer}.minimize")
        lines += [f"  refused: {e}" for e in self.errors]
        lines += [f"  note: {w}" for w in self.warnings]
        return "\n".join(lines)


def plan_meta_optimizers(strategy: DistributedStrategy, optimizer: Any = None) -> MetaPlan:
    """The plan for `strategy` on this worker (needs ``fleet.init``: data parallel reads worker_num)."""
    world = env.worker_num()
    defaults = DistributedStrategy()
    rows: list[PlanRow] = []
    warnings: list[str] = []
    for meta in META_OPTIMIZERS:
        if meta.field is None:
            if world == 1:
                rows.append(PlanRow(meta.name, False, "fleet.worker_num()=1"))
            elif strategy.pipeline:
                rows.append(
                    PlanRow(
                        meta.name,
                        False,
                        "strategy.pipeline=True replicates over pipeline_configs['dp_degree']",
                    )
                )
            else:
                rows.append(PlanRow(meta.name, True, f"fleet.worker_num()={world}"))
            continue
        on = bool(getattr(strategy, meta.field))
        reason = f"strategy.{meta.field}={on}"
        if on and meta.name == "recompute" and strategy.recompute_configs["enable_offload"]:
            reason += " (+offload: recompute_configs['enable_offload']=True)"
        cfg = f"{meta.field}_configs"
        if not on and meta.field in CONFIGS and getattr(strategy, cfg) != getattr(defaults, cfg):
            warnings.append(f"strategy.{cfg} is set but strategy.{meta.field}=False: the config is unused")
        rows.append(PlanRow(meta.name, on, reason))

    errors: list[Exception] = []
    for name in UNSUPPORTED_FEATURES:
        if getattr(strategy, name):
            errors.append(
                NotImplementedError(
                    f"strategy.{name}=True: Fleet's {name} meta optimizer is not implemented in metaopt; "
                    f"set strategy.{name} = False"
                )
            )
    for flags, why in CONFLICTS:
        if all(getattr(strategy, f) for f in flags):
            both = " and ".join(f"strategy.{f}=True" for f in flags)
            errors.append(ValueError(f"{both} cannot be combined: {why}"))
    for w in warnings:
        logger.warning(w)
    name = type(optimizer).__name__ if optimizer is not None else "the inner optimizer"
    return MetaPlan(rows, name, errors, warnings)


class DistributedOptimizer:
    """Fleet's distributed optimizer: ``minimize`` applies the strategy's meta optimizers
    (``META_OPTIMIZERS`` order) around `optimizer` and rewrites ``loss.program`` in place."""

    def __init__(self, optimizer: Any, strategy: DistributedStrategy) -> None:
        self.user_defined_optimizer = optimizer
        # A copy, as in Fleet: changing the strategy afterwards does not change this optimizer.
        self.user_defined_strategy = strategy.copy()
        self.applied_meta_list: list[str] = []

    @property
    def inner_opt(self) -> Any:
        return self.user_defined_optimizer

    def plan(self, loss: Var | None = None) -> MetaPlan:
        """What ``minimize`` would apply (printable); `loss` is accepted for memory plans to come."""
        return plan_meta_optimizers(self.user_defined_strategy, self.user_defined_optimizer)

    def minimize(
        self,
        loss: Var,
        startup_program: Any = None,
        parameter_list: Any = None,
        no_grad_set: Any = None,
    ) -> tuple[Any, Any]:
        """Rewrite ``loss.program`` in place into a training program; (optimize_ops, params_grads).

        Everything refused (unsupported features, conflicts, meta optimizers not
        implemented) is refused before the program is touched.
        """
        if not isinstance(loss, Var):
            raise TypeError(f"minimize: loss must be a Var of a Program, got {type(loss).__name__}")
        if loss.program is None:
            raise ValueError(f"minimize: loss {loss.name!r} belongs to no program (use program.loss)")
        strategy_ = self.user_defined_strategy
        if strategy_.recompute_configs["enable_offload"] and not strategy_.recompute:
            raise ValueError(
                "recompute_configs['enable_offload']=True needs strategy.recompute=True: offload moves "
                "the recompute checkpoints to host memory"
            )
        plan = self.plan(loss)
        plan.check()
        strategy = self.user_defined_strategy
        metas = {m.name: m for m in META_OPTIMIZERS}
        opt = self.user_defined_optimizer
        wrappers = []
        for name in reversed(plan.applied):
            opt = metas[name].apply(opt, strategy)
            wrappers.append(opt)
        result = opt.minimize(loss, startup_program, parameter_list, no_grad_set)
        for w in wrappers:  # what a meta optimizer reports (Fleet users read opt.<report>)
            for report in (
                "amp_plan",
                "recompute_plan",
                "memory_report",
                "data_parallel_plan",
                "pipeline_plan",
            ):
                if getattr(w, report, None) is not None:
                    setattr(self, report, getattr(w, report))
        self.applied_meta_list = plan.applied
        logger.info("applied meta optimizers: %s", self.applied_meta_list)
        return result


def distributed_optimizer(
    optimizer: Any, strategy: DistributedStrategy | None = None
) -> DistributedOptimizer:
    """Fleet's ``fleet.distributed_optimizer``: `optimizer` with `strategy`'s meta optimizers.

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

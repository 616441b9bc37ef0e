"""The recompute meta optimizer: Fleet's RecomputeOptimizer on metaopt's passes
(with ``enable_offload``, the checkpoints then wait in host memory: passes/offload.py).

It wraps an inner optimizer (or another meta optimizer): ``minimize`` lets the inner
one append the backward and the updates to a copy of the program, rewrites that copy
with `metaopt.passes.recompute.recompute`, and only then replaces the user's program,
so a refused configuration leaves the program untouched. The plan it used is kept
in ``recompute_plan`` (printable: segments, held values, skipped names) and its
predicted effect in ``memory_report`` (bytes per checkpoint, largest segment,
predicted activation peak with and without, at recompute_configs['budget_batch_size']); both are logged, and a
plan that saves nothing gets a warning.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from metaopt.dump import dump
from metaopt.ir import Var
from metaopt.passes.offload import offload
from metaopt.passes.recompute import (
    MemoryReport,
    RecomputePlan,
    memory_report,
    plan_recompute,
    recompute,
)

logger = logging.getLogger("metaopt.fleet")


class RecomputeOptimizer:
    def __init__(self, inner: Any, configs: Any) -> None:
        if not configs["checkpoints"]:
            raise ValueError(
                "strategy.recompute=True needs recompute_configs['checkpoints'] (names or patterns)"
            )
        self.inner = inner
        self.checkpoints = list(configs["checkpoints"])
        self.seed_random_ops = bool(configs["seed_random_ops"])
        self.enable_offload = bool(configs["enable_offload"])
        self.offload_checkpoints = configs["offload_checkpoints"]
        self.checkpoint_shape = list(configs["checkpoint_shape"])
        self.policy = configs["policy"]
        self.keep_op_types = tuple(configs["keep_op_types"])
        self.memory_budget = configs["memory_budget"]
        if self.memory_budget is not None and "auto" not in self.checkpoints:
            raise ValueError(
                "recompute_configs['memory_budget'] chooses checkpoints: it needs checkpoints=['auto'] "
                f"(got {self.checkpoints})"
            )
        self.batch = configs["budget_batch_size"]
        self.recompute_plan: RecomputePlan | None = None
        self.memory_report: MemoryReport | None = None

    def minimize(
        self, loss: Var, startup_program: Any = None, parameter_list: Any = None, no_grad_set: Any = None
    ) -> tuple[list, list]:
        program = loss.program
        work = program.clone()
        _, params_grads = self.inner.minimize(
            work.var(loss.name), startup_program, parameter_list, no_grad_set
        )
        how = {
            "checkpoints": self.checkpoints,
            "policy": self.policy,
            "keep_op_types": self.keep_op_types,
            "memory_budget": self.memory_budget,
            "batch": self.batch,
        }
        self.recompute_plan = plan_recompute(work, **how)
        rewritten = recompute(work, **how, seed_random_ops=self.seed_random_ops)
        dump(rewritten, "recompute")
        if self.enable_offload:
            rewritten = offload(
                rewritten,
                checkpoints=self.recompute_plan.checkpoints,
                offload_checkpoints=self.offload_checkpoints,
                checkpoint_shape=self.checkpoint_shape,
            )
            dump(rewritten, "offload")
        self.memory_report = memory_report(work, self.recompute_plan, rewritten, batch=self.batch)
        logger.info("%s\n%s", self.recompute_plan, self.memory_report)
        if not self.memory_report.saves_memory:
            warnings.warn(
                f"recompute with checkpoints {self.checkpoints} does not lower the predicted activation "
                f"peak ({self.memory_report.peak_before:,} -> {self.memory_report.peak_after:,} bytes at "
                f"batch {self.batch}): choose checkpoints inside the model, one per block",
                stacklevel=2,
            )
        program.replace_with(rewritten)
        optimize_ops = [op for op in program.ops if op.role == "optimize"]
        return optimize_ops, params_grads

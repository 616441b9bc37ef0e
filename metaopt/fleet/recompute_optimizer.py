"""The recompute meta optimizer: Fleet's RecomputeOptimizer on metaopt's passes.

It wraps an inner optimizer (or another meta optimizer): ``minimize`` lets the inner
one append the backward and the updates to a copy of the program, rewrites that copy
with `metaopt.passes.recompute.recompute`, and only then replaces the user's program,
so a refused configuration leaves the program untouched. The plan it used is kept
in ``recompute_plan`` (printable: segments, held values, skipped names).
"""

from __future__ import annotations

import logging
from typing import Any

from metaopt.ir import Var
from metaopt.passes.recompute import RecomputePlan, plan_recompute, recompute

logger = logging.getLogger("metaopt.fleet")


class RecomputeOptimizer:
    def __init__(self, inner: Any, configs: Any) -> None:
        if configs["enable_offload"]:
            raise NotImplementedError(
                "recompute_configs['enable_offload']=True: offloading checkpoints to host memory "
                "is not implemented yet; set it to False"
            )
        if configs["policy"] != "full":
            raise NotImplementedError(
                f"recompute_configs['policy']={configs['policy']!r}: only 'full' is implemented yet"
            )
        if configs["memory_budget"] is not None:
            raise NotImplementedError("recompute_configs['memory_budget'] (automatic checkpoint selection)")
        if not configs["checkpoints"]:
            raise ValueError(
                "strategy.recompute=True needs recompute_configs['checkpoints'] (names or patterns)"
            )
        self.inner = inner
        self.checkpoints = list(configs["checkpoints"])
        self.seed_random_ops = bool(configs["seed_random_ops"])
        self.recompute_plan: RecomputePlan | None = None

    def minimize(
        self, loss: Var, startup_program: Any = None, parameter_list: Any = None, no_grad_set: Any = None
    ) -> tuple[list, list]:
        program = loss.program
        work = program.clone()
        _, params_grads = self.inner.minimize(
            work.var(loss.name), startup_program, parameter_list, no_grad_set
        )
        self.recompute_plan = plan_recompute(work, checkpoints=self.checkpoints)
        logger.info("%s", self.recompute_plan)
        program.replace_with(
            recompute(work, checkpoints=self.checkpoints, seed_random_ops=self.seed_random_ops)
        )
        optimize_ops = [op for op in program.ops if op.role == "optimize"]
        return optimize_ops, params_grads

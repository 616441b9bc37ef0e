"""The data-parallel meta optimizer: what Fleet's collective mode (and DDP) does.

``minimize`` lets the inner optimizer append the backward and the updates to a copy of
the program, then `metaopt.passes.data_parallel` averages every grad over the workers
(fused buckets of ``strategy.fuse_grad_size_in_MB``, one op per grad when
``strategy.fuse_all_reduce_ops`` is False) before the updates read it. Then, like DDP's
constructor (and Fleet's startup-program broadcast), every worker takes rank 0's
initial values of the params and buffers: each worker may have built its model with
other random weights. ``minimize`` is therefore a collective: every worker calls it.
The plan is kept in ``data_parallel_plan`` and logged in Fleet's words
("all_reduce ops: N, after fusion: M").
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from metaopt.dump import dump
from metaopt.fleet import env
from metaopt.ir import Program, Var
from metaopt.passes.data_parallel import DataParallelPlan, data_parallel, plan_data_parallel

logger = logging.getLogger("metaopt.fleet")


class DataParallelOptimizer:
    def __init__(self, inner: Any, strategy: Any) -> None:
        from metaopt.runtime.comm import require_process_group

        require_process_group()  # refused before the program is touched
        self.inner = inner
        self.world_size = env.worker_num()
        self.bucket_bytes = int(strategy.fuse_grad_size_in_MB) * 2**20 if strategy.fuse_all_reduce_ops else 0
        self.data_parallel_plan: DataParallelPlan | None = None

    def minimize(
        self, loss: Var, startup_program: Any = None, parameter_list: Any = None, no_grad_set: Any = None
    ) -> tuple[list, list]:
        program = loss.program
        work = program.clone()
        _, params_grads = self.inner.minimize(
            work.var(loss.name), startup_program, parameter_list, no_grad_set
        )
        grads = [g.name if isinstance(g, Var) else g for _, g in params_grads]
        how = {"grads": grads, "world_size": self.world_size, "bucket_bytes": self.bucket_bytes}
        self.data_parallel_plan = plan_data_parallel(work, **how)
        rewritten = data_parallel(work, **how)
        dump(rewritten, "data_parallel")
        logger.info("%s", self.data_parallel_plan)
        broadcast_initial_values(rewritten)
        program.replace_with(rewritten)
        optimize_ops = [op for op in program.ops if op.role == "optimize"]
        return optimize_ops, params_grads


def broadcast_initial_values(p: Program, src: int = 0) -> int:
    """Overwrite the initial values of `p`'s params and buffers with worker `src`'s (in
    place, in `p.values`); returns the bytes broadcast. Every worker must call it."""
    from metaopt.runtime.comm import Communicator

    device = torch.device("cuda", env.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    comm = Communicator(device)
    total = 0
    for v in p.vars.values():
        if v.kind in ("param", "buffer") and v.name in p.values:
            t = p.values[v.name]
            if not t.is_contiguous():
                t = p.values[v.name] = t.contiguous()
            comm.broadcast(t, src, f"the initial value of {v.name!r}")
            total += t.numel() * t.element_size()
    logger.info("data parallel: broadcast %d bytes of params and buffers from rank %d", total, src)
    return total

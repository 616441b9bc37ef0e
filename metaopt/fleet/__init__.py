"""metaopt.fleet: PaddlePaddle Fleet's front end (collective mode).

    from metaopt import fleet
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-4), strategy)
    optimize_ops, params_grads = opt.minimize(loss)      # rewrites loss.program in place

State (this worker's rank, the job's size, its hybrid-parallel groups) lives in
``metaopt.fleet.env``, the rank layout in ``metaopt.layout`` (read from the strategy by
``metaopt.fleet.topology``); the meta training rewrite's steps, in their literal order, in
``metaopt.fleet.steps.STEPS``.
"""

from metaopt.fleet.distributed_optimizer import DistributedOptimizer, TrainPlan, distributed_optimizer
from metaopt.fleet.env import (
    barrier_worker,
    get_hybrid_communicate_group,
    init,
    is_first_worker,
    is_initialized,
    local_rank,
    simulate,
    worker_endpoints,
    worker_index,
    worker_num,
)
from metaopt.fleet.io import load_persistables, save_persistables
from metaopt.fleet.pretrained import init_from_module, load_pretrained, save_pretrained
from metaopt.fleet.steps import STEPS
from metaopt.fleet.strategy import DistributedStrategy
from metaopt.planner.search import Plan, Plans, plan

__all__ = [
    "STEPS",
    "Plan",
    "Plans",
    "DistributedOptimizer",
    "DistributedStrategy",
    "TrainPlan",
    "barrier_worker",
    "distributed_optimizer",
    "get_hybrid_communicate_group",
    "init",
    "init_from_module",
    "is_first_worker",
    "is_initialized",
    "load_persistables",
    "load_pretrained",
    "plan",
    "local_rank",
    "save_persistables",
    "save_pretrained",
    "simulate",
    "worker_endpoints",
    "worker_index",
    "worker_num",
]

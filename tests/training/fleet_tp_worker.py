"""One worker of tensor parallel through fleet (started by tests/fleet/test_fleet_tensor_parallel.py
with RANK/WORLD_SIZE/MASTER_*): ``python fleet_tp_worker.py OUT DP MP``.

fleet.init lays the DP x MP workers out from hybrid_configs; the optimizer's strategy turns on
tensor parallel with tp_worker's gpt column/row layers. Each data-parallel replica is fed its
half (1/DP) of tp_worker's full batch, every MP rank of a replica the same half. 3 SGD steps;
writes its losses, (local) params and plans to ``OUT/gpt.rank<r>.pt``."""

from __future__ import annotations

import sys

import torch
import tp_worker

import metaopt
from metaopt import fleet

NAME = "gpt"


def strategy(dp: int, mp: int) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": dp, "mp_degree": mp}
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"column": tp_worker.COLUMN[NAME], "row": tp_worker.ROW[NAME]}
    return s


def replica_batch(step: int, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """This replica's contiguous 1/dp of the step's full batch."""
    full = tp_worker.batch(NAME, step)
    n = tp_worker.BATCH // dp
    return {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in full.items()}


def main() -> None:
    out, dp, mp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = strategy(dp, mp)
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    program = tp_worker.export(NAME)
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=tp_worker.LR), s)
    opt.minimize(program.loss)
    exe = metaopt.Executor("cpu")
    losses = []
    for step in range(tp_worker.STEPS):
        feed = replica_batch(step, hcg.get_data_parallel_rank(), dp)
        (loss,) = exe.run(program, feed=feed, fetch_list=[program.loss])
        losses.append(float(loss))
    result = {
        "losses": losses,
        "params": {v.name: exe.scope[v.name].clone() for v in program.params()},
        "applied": list(opt.applied_meta_list),
        "plan": str(opt.plan()),
        "dp_plan": str(opt.data_parallel_plan),
        "ops": [
            f"{op.type} {sorted(op.attrs.items())}" for op in program.ops if op.role in ("comm", "startup")
        ],
        "dp_rank": hcg.get_data_parallel_rank(),
        "mp_rank": hcg.get_model_parallel_rank(),
    }
    torch.save(result, f"{out}/{NAME}.rank{fleet.worker_index()}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

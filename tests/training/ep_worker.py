"""One expert-parallel worker (started by tests/passes/test_expert_parallel.py with RANK/
WORLD_SIZE/MASTER_*; ep_degree = the world size, group = every worker).

argv: out_dir name...  (MoE zoo entries). For each, in float64 (dropout 0): the entry exported,
rewritten by the expert-parallel pass for this worker, and its param grads on this worker's own
batch (seed 1 + rank: ep here overlaps data parallel, as Paddle's ep_degree does). Data
parallel's reduction, done here by hand: a dense param's grad averaged over the workers, an
expert param's (this worker's experts, every worker's tokens) divided by the world size. The
truth: float64 torch's grads of the module on each worker's batch, averaged (what data parallel
on one process per batch computes: the router's aux loss is each batch's own, as on every peer).

Writes `<out>/<name>.rank<r>.pt`: the worst relative error (`harness.float64_worst`, which raises
past its bar), the printed program, and the expert params' local shapes."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from zoo import harness, models

from metaopt import fleet
from metaopt.passes.expert_parallel import expert_parallel, plan_expert_parallel

BATCH = 3


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    for name in names:
        entry = models.get(name)
        module, program = harness.export64(entry)
        batches = [tuple(harness._double(x) for x in entry.inputs(BATCH, 1 + r)) for r in range(world)]
        truth = [harness.torch_grads(module, b, double=True) for b in batches]
        ref = {k: sum(t[k] for t in truth) / world for k in truth[0]}
        plan = plan_expert_parallel(program, ep_degree=world, ep_rank=rank, group=list(range(world)))
        q = expert_parallel(program, plan=plan)
        grads = harness.metaopt_grads(q, module, batches[rank])
        ours, mine = {}, {}
        for k, g in grads.items():
            if k in plan.params:
                n = plan.params[k] // world
                ours[k], mine[k] = g / world, ref[k][rank * n : (rank + 1) * n]
            else:
                dist.all_reduce(g)
                ours[k], mine[k] = g / world, ref[k]
        worst = harness.float64_worst(entry, ours, mine, "expert-parallel grads", island=True)
        shapes = {k: tuple(q.vars[k].shape) for k in plan.params}
        torch.save(
            {"worst": worst, "program": str(q), "plan": str(plan), "shapes": shapes},
            f"{out}/{name}.rank{rank}.pt",
        )
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

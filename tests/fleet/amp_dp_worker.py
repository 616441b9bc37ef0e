"""One data-parallel AMP worker (started by test_amp_optimizer.py with RANK/WORLD_SIZE/MASTER_*).

Trains the mlp with fleet AMP (float16, dynamic loss scaling) and data parallel; at step
POISON only rank 1's batch holds an inf, so only rank 1's local grads overflow. The
check runs on the all-reduced grads, so both ranks must skip that step. Writes each
step's loss scale, step counter and params to `<out>/rank<r>.pt`.
"""

from __future__ import annotations

import sys

import export_cache
import torch

import metaopt
import programs
from metaopt import fleet

STEPS = 5
POISON = 2


def main() -> None:
    out = sys.argv[1]
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    mod = programs.get("mlp")
    model = mod.build("tiny", seed=rank)
    main = export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name="mlp")
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 1024.0, "decr_every_n_nan_or_inf": 1, "decr_ratio": 0.5}
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), strategy)
    opt.minimize(main.loss)
    assert opt.applied_meta_list == ["amp", "data_parallel"], opt.applied_meta_list
    exe = metaopt.Executor("cpu")
    trace = []
    for step in range(STEPS):
        x, label = mod.example_inputs("tiny", 4, seed=10 * step + rank)
        if step == POISON and rank == 1:
            x[0, 0] = float("inf")
        exe.run(main, feed={"x": x, "label": label}, fetch_list=[main.loss])
        trace.append(
            {
                "loss_scaling": exe.scope["loss_scaling"].item(),
                "global_step": exe.scope["global_step"].item(),
                "params": {v.name: exe.scope[v.name].clone() for v in main.params()},
            }
        )
    torch.save(trace, f"{out}/rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

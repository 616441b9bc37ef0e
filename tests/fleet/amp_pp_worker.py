"""One AMP pipeline worker (started by test_amp_optimizer.py with RANK/WORLD_SIZE/MASTER_*).

The mlp in 2 stages (fleet's pipeline, 2 micro-batches) with fleet AMP (float16, dynamic
loss scaling). Only stage 0 overflows at step POISON: one of its grads is multiplied by a
persistable scalar of its own scope that the worker sets to inf on that step. Stage 1's
grads stay finite, so it skips that step only if the stages agree on the overflow flag.
Writes each step's loss scale, step counter and params to `<out>/rank<r>.pt`.
"""

from __future__ import annotations

import sys

import export_cache
import torch

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import Op, Var

STEPS = 5
POISON = 2


def poison_one_grad(main: metaopt.Program, grad: str) -> None:
    """`grad` * `poison` (a persistable scalar) replaces `grad` for every later reader."""
    from metaopt.passes.pipeline_phases import pipeline_phases

    i = main.producers()[grad]
    main.add_var(Var("poison", "float32", (), "opt_state"), torch.tensor(1.0))
    main.add_var(Var(f"{grad}@POISONED", "float32", main.vars[grad].shape, "grad"))
    for op in main.ops[i + 1 :]:
        op.inputs = [f"{grad}@POISONED" if x == grad else x for x in op.inputs]
    op = Op("Mul", [grad, "poison"], [f"{grad}@POISONED"], role="backward", stage=main.ops[i].stage)
    main.ops.insert(i + 1, op)
    # an edited stage program is cut into its phases again, as minimize left it
    main.replace_with(pipeline_phases(main))


def main() -> None:
    out = sys.argv[1]
    schedule = sys.argv[2] if len(sys.argv) > 2 else "1F1B"
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    mod = programs.get("mlp")
    main = export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 1024.0, "decr_every_n_nan_or_inf": 1, "decr_ratio": 0.5}
    strategy.pipeline = True
    cuts = ["relu1", "fc2", "fc3"] if schedule == "ZBV" else ["fc2"]  # ZB-V: 4 chunks, 2 per worker
    strategy.pipeline_configs = {"accumulate_steps": 2, "cuts": cuts, "schedule_mode": schedule}
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), strategy)
    opt.minimize(main.loss)
    assert opt.applied_meta_list == ["amp", "pipeline"], opt.applied_meta_list
    if rank == 0:
        poison_one_grad(main, "fc1.bias@GRAD")
    exe = metaopt.Executor("cpu")
    trace = []
    for step in range(STEPS):
        x, label = mod.example_inputs("tiny", 4, seed=step)
        if rank == 0 and "poison" in exe.scope:
            exe.scope["poison"].fill_(float("inf") if step == POISON else 1.0)
        exe.run(main, feed={"x": x, "label": label}, fetch_list=["loss"])
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

"""One zero-bubble pipeline worker (started by test_zero_bubble.py through tests/workers.py).

Each case "model:schedule:optimizer[:extra...]" exports the zoo's model (the same seed on every
worker), splits it into one stage per worker with fleet's pipeline (4 micro-batches, cuts
"auto"), trains STEPS steps on the whole batch (every worker is fed it) and writes
`<out>/<case>.rank<r>.pt`: the losses (last stage), this worker's params, the executor's peak
bytes beside `estimate_pipeline_memory`'s and the step's profile (each action's compute
seconds). extra: "drop" (dropout 0.1),
"recompute" (each block a checkpoint).
"""

from __future__ import annotations

import os
import sys

import torch
from training_cases import BATCH, CHECKPOINTS, STEPS, batch, export

import metaopt
from metaopt import fleet
from metaopt.report.pipeline_memory import estimate_pipeline_memory
from metaopt.runtime.pipeline import last_step_profile

MICRO_BATCHES = 4


def make_optimizer(opt: str) -> metaopt.optimizer.Optimizer:
    if opt == "sgd":
        return metaopt.optimizer.SGD(learning_rate=0.05)
    return metaopt.optimizer.Adam(learning_rate=1e-2)


def train_case(case: str, world: int) -> dict:
    name, schedule, opt, *extra = case.split(":")
    main = export(name, dropout=0.1 if "drop" in extra else 0.0)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": MICRO_BATCHES, "schedule_mode": schedule}
    if "recompute" in extra:
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": CHECKPOINTS[name]}
    metaopt.seed(0)
    loss_name = main.loss.name
    fleet.distributed_optimizer(make_optimizer(opt), strategy).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    losses = []
    for step in range(STEPS):
        (loss,) = exe.run(main, feed=batch(name, step), fetch_list=[loss_name])
        losses.append(None if loss is None else float(loss))
    prof = last_step_profile(exe, main)
    picture = None
    if extra == [] and opt == "sgd":  # the last step's picture, every worker's (a collective)
        pic = metaopt.schedule_picture(exe, main, out=os.path.join(OUT[0], "picture"), name=schedule)
        picture = {"bubble": pic.bubble, "ideal_bubble": pic.ideal_bubble, "step_s": pic.step_s}
    return {
        "picture": picture,
        "losses": losses,
        "params": {v.name: exe.scope[v.name].clone() for v in main.params()},
        "peak": exe.memory_stats()["peak_bytes"],
        "predicted_peak": estimate_pipeline_memory(main, batch=BATCH).peak_bytes,
        "actions": [a for a, _ in prof.actions],
        "program": str(main),
    }


OUT: list[str] = []  # the folder the results go to


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    OUT.append(out)
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    for case in cases:
        torch.save(train_case(case, world), f"{out}/{case}.rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

"""A data-parallel job that survives a crash, as a Fleet user writes one: each step is saved
(fleet.save_persistables, a sharded checkpoint in a folder both hosts see), and a start (or a
restart by metaoptrun --max_restarts) first loads the latest one and goes on from its step.
dp_worker's plain mlp case: 5 Adam steps, each host on half of each batch.

argv: CHECKPOINTS OUT [CRASH_AT]: with CRASH_AT, rank 1 of the first attempt dies (exit 3)
right after saving that step. Rank 0 writes the final params to OUT."""

from __future__ import annotations

import os
import sys

import torch
from dp_worker import BATCH, STEPS, full_batch

import metaopt
import programs
from metaopt import fleet


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    crash_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    mod = programs.get("mlp")
    main = metaopt.export(
        mod.build("tiny", seed=100 + rank, dropout=0.0), mod.example_inputs("tiny", 4, seed=1)
    )
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_reduce_ops = False
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), strategy).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    start = 0
    if os.path.exists(os.path.join(ckpt, "latest")):
        fleet.load_persistables(exe, ckpt, main)
        start = int(exe.scope["global_step"])
    print(f"rank {rank} attempt {attempt} starts at step {start}", flush=True)
    share = BATCH // world
    for step in range(start, STEPS):
        part = [x[rank * share : (rank + 1) * share] for x in full_batch("mlp", step)]
        exe.run(main, feed=dict(zip(mod.INPUT_NAMES, part, strict=True)), fetch_list=[main.loss])
        fleet.save_persistables(exe, ckpt, main, step=step + 1)
        if attempt == 0 and rank == 1 and step + 1 == crash_at:
            os._exit(3)  # a crash, after the step's checkpoint is whole
    if rank == 0:
        torch.save({v.name: exe.scope[v.name].clone() for v in main.params()}, out)
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

"""A 2-worker data-parallel job whose rank 1 dies (or stalls) before step 1's all-reduce.

argv: mode ("die" | "stall"). Rank 0 must fail with the communicator's error, not hang.
"""

from __future__ import annotations

import os
import sys
import time

import export_cache

import metaopt
import programs
from metaopt import fleet


def main() -> None:
    mode = sys.argv[1]
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    mod = programs.get("mlp")
    main = export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1)).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    for step in range(3):
        if rank == 1 and step == 1:
            if mode == "die":
                os._exit(3)
            time.sleep(120)  # alive but never reaches the collective
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=step), strict=True))
        exe.run(main, feed=feed, fetch_list=[main.loss])
        print(f"rank {rank} step {step} done", flush=True)


if __name__ == "__main__":
    main()

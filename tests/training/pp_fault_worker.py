"""A 2-stage mlp pipeline whose workers are fed batches of different sizes (rank 0: 8,
rank 1: 6): their micro-batches disagree, which both must report naming the var (not
hang). argv[1] "first": from the first step on; "late": the first step agrees (its edges
are verified, later messages go without headers), the second disagrees."""

from __future__ import annotations

import sys

import export_cache

import metaopt
import programs
from metaopt import fleet


def main() -> None:
    when = sys.argv[1] if len(sys.argv) > 1 else "first"
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    mod = programs.get("mlp")
    main = export_cache.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": 2, "cuts": ["fc2"]}
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), strategy).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    for step in range(2 if when == "late" else 1):
        agree = when == "late" and step == 0
        batch = 8 if rank == 0 or agree else 6
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", batch, seed=step), strict=True))
        exe.run(main, feed=feed, fetch_list=["loss"])
        print(f"rank {rank} finished step {step}", flush=True)


if __name__ == "__main__":
    main()

"""A 2-stage mlp pipeline whose rank 0 is fed a batch of 8 and rank 1 a batch of 6:
their micro-batches disagree, which both must report naming the var (not hang)."""

from __future__ import annotations

import metaopt
import programs
from metaopt import fleet


def main() -> None:
    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    mod = programs.get("mlp")
    main = metaopt.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": 2, "cuts": ["fc2"]}
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), strategy).minimize(main.loss)
    batch = 8 if rank == 0 else 6
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", batch, seed=0), strict=True))
    metaopt.Executor("cpu").run(main, feed=feed, fetch_list=["loss"])
    print(f"rank {rank} finished a step", flush=True)


if __name__ == "__main__":
    main()

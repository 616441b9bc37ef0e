"""One of 2 workers whose rank 1 builds another training program than rank 0 (or never reaches
minimize); started by test_workers_agree.py. argv: mode.

  hidden    data parallel; rank 1's mlp is 48 wide, rank 0's 32: fc1.weight differs
  bucket    data parallel; rank 1 all-reduces each grad alone (fuse_all_reduce_ops=False): an op
  pipeline  a 2-stage pipeline; rank 1's mlp is 48 wide
  stages    sharding over both; rank 0 at stage 2, rank 1 at stage 3 (whose initial broadcast
            waited out METAOPT_COMM_TIMEOUT before the strategies were compared)
  hang      data parallel; rank 1 sleeps instead of calling minimize

Prints how long minimize took before it failed, then lets the error propagate as a user sees it.
"""

from __future__ import annotations

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
    hidden = 48 if rank == 1 and mode in ("hidden", "pipeline") else 32
    model = mod.build("tiny", seed=0, hidden_size=hidden)
    main = export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name="mlp")
    strategy = fleet.DistributedStrategy()
    if mode == "bucket" and rank == 1:
        strategy.fuse_all_reduce_ops = False
    if mode == "stages":
        strategy.sharding = True
        strategy.sharding_configs = {"stage": 3 if rank == 1 else 2, "sharding_degree": 2}
    if mode == "pipeline":
        strategy.pipeline = True
        strategy.pipeline_configs = {"accumulate_steps": 2, "cuts": ["fc2"]}
    if mode == "hang" and rank == 1:
        time.sleep(120)  # alive, but never reaches minimize's exchange
    t0 = time.perf_counter()
    try:
        fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), strategy).minimize(main.loss)
    finally:
        print(f"rank {rank} minimize ended after {time.perf_counter() - t0:.1f}s", flush=True)
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=0), strict=True))
    metaopt.Executor("cpu").run(main, feed=feed, fetch_list=[main.loss])
    print(f"rank {rank} ran a step", flush=True)


if __name__ == "__main__":
    main()

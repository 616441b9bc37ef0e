"""One worker of pipeline x tensor parallel (x data parallel), started by test_hybrid_pipeline.py
with RANK/WORLD_SIZE/MASTER_*: ``python hybrid_pp_worker.py OUT PROGRAM DP MP PP OPT [OPT ...]``.

PROGRAM: tp_worker's export of the tiny GPT, saved as ONNX by the test (loading takes milliseconds,
exporting seconds: on a small machine 8 workers exporting at once would dominate the test).

fleet.init lays the DP x MP x PP workers out from hybrid_configs; the optimizer's strategy turns
on tensor parallel (tp_worker's gpt column/row layers) and a 1F1B pipeline cut at
``transformer.h.1`` (the tiny GPT's two blocks, one per stage; wte is read by the embedding on
stage 0 and the tied LM head on stage 1). Each data-parallel replica is fed its 1/DP of
tp_worker's full batch (every MP rank and every stage of a replica the same), in MICRO_BATCHES
micro-batches. For each optimizer named (sgd: tp_worker's SGD; adam), on a fresh copy of the
export: 3 steps; writes ``OUT/<opt>.rank<r>.pt`` with the losses (last stage), the (local)
params, this worker's coordinate and whom its pipeline runtime talks to.

``mismatch``: instead, rank 0's fleet.init gets hybrid_configs (dp_degree=1, mp_degree=WORLD)
and the others' none; each prints the error fleet.init raised and exits 1.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import tp_worker

import metaopt
from metaopt import fleet

NAME = "gpt"
CUTS = ["transformer.h.1"]
MICRO_BATCHES = 2


def strategy(dp: int, mp: int, pp: int) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": dp, "mp_degree": mp, "pp_degree": pp}
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"column": tp_worker.COLUMN[NAME], "row": tp_worker.ROW[NAME]}
    s.pipeline = True
    s.pipeline_configs = {"cuts": CUTS, "accumulate_steps": MICRO_BATCHES, "schedule_mode": "1F1B"}
    return s


def optimizer(name: str) -> metaopt.optimizer.Optimizer:
    """ "sgd" or "adam"; a "-zbh1" suffix (the ZB-H1 schedule: `train`) is not the optimizer's."""
    if name.split("-")[0] == "sgd":
        return metaopt.optimizer.SGD(learning_rate=tp_worker.LR)
    return metaopt.optimizer.Adam(learning_rate=1e-2)


def replica_batch(step: int, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """This replica's contiguous 1/dp of the step's full batch."""
    full = tp_worker.batch(NAME, step)
    n = tp_worker.BATCH // dp
    return {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in full.items()}


def train(exported: metaopt.Program, opt: str, s: fleet.DistributedStrategy) -> dict:
    hcg = fleet.get_hybrid_communicate_group()
    program = exported.clone()
    loss_name = program.loss.name  # a stage other than the last has no loss var: fetch by name
    if opt.endswith("-zbh1"):  # the zero-bubble schedule beside tensor parallel
        s = s.copy()
        s.pipeline_configs = {**s.pipeline_configs, "schedule_mode": "ZBH1"}
    fleet.distributed_optimizer(optimizer(opt), s).minimize(program.loss)
    exe = metaopt.Executor("cpu")
    losses = []
    for step in range(tp_worker.STEPS):
        feed = replica_batch(step, hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size())
        (loss,) = exe.run(program, feed=feed, fetch_list=[loss_name])
        losses.append(None if loss is None else float(loss))
    state = exe._pipeline_runner(program).state  # where this worker's sends and all-reduces go
    return {
        "losses": losses,
        "params": {v.name: exe.scope[v.name].clone() for v in program.params()},
        "coord": [hcg.get_data_parallel_rank(), hcg.get_stage_id(), hcg.get_model_parallel_rank()],
        "stage": program.pipeline.stage,
        "pipe_peers": [state.rank_of(k) for k in range(program.pipeline.num_stages)],
        "dp_ranks": state.dp_ranks(),
        "sends": sum(1 for op in program.ops if "peer" in op.attrs),
    }


def mismatch() -> None:
    world = int(os.environ["WORLD_SIZE"])
    s = None
    if int(os.environ["RANK"]) == 0:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"dp_degree": 1, "mp_degree": world}
    t0 = time.perf_counter()
    try:
        fleet.init(is_collective=True, strategy=s)
    finally:
        print(f"fleet.init ended after {time.perf_counter() - t0:.1f}s", flush=True)


def main() -> None:
    if sys.argv[1] == "mismatch":
        mismatch()
        return
    out, program, dp, mp, pp, *opts = sys.argv[1:]
    s = strategy(int(dp), int(mp), int(pp))
    fleet.init(is_collective=True, strategy=s)
    exported = metaopt.load(program)
    for opt in opts:
        torch.save(train(exported, opt, s), f"{out}/{opt}.rank{fleet.worker_index()}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

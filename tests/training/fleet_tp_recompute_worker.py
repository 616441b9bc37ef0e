"""One worker of recompute beside tensor parallel, through fleet (started by
tests/fleet/test_fleet_recompute_partition.py with RANK/WORLD_SIZE/MASTER_*):
``python fleet_tp_recompute_worker.py OUT DROPOUT CASE...``.

MP=2 over the 2 workers (hybrid_configs mp_degree=2, tp_worker's gpt column/row layers); each
CASE is one strategy on the same export (DROPOUT: the model's dropout; each case seeds both RNG
streams alike with ``metaopt.seed``, so every case draws the same masks): ``tp`` tensor parallel
alone, ``rc`` + recompute, ``part`` + recompute_configs enable_partition, ``off`` +
enable_offload, ``off_part`` + both. 3 SGD steps on tp_worker's full batches (every MP rank the
same); writes, per case, the losses, (local) params, the executor's memory stats and per-op
timeline of the last step, the estimate's timeline of the same program and what it holds at the
first backward op, the memory report and the partition plan, to
``OUT/<case>.rank<r>.pt``."""

from __future__ import annotations

import sys

import export_cache
import fleet_tp_worker
import torch
import tp_worker

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import roles
from metaopt.passes.memory_estimate import estimate_memory, where_alive

NAME = "gpt"
# the embedding's output and every block's: drop and h.0 open recomputed segments (partitioned),
# h.1 is the last (kept whole)
CHECKPOINTS = ["transformer.drop", "transformer.h.*"]
CASES = {
    "tp": {},
    "rc": {"checkpoints": CHECKPOINTS},
    "part": {"checkpoints": CHECKPOINTS, "enable_partition": True},
    "off": {"checkpoints": CHECKPOINTS, "enable_offload": True},
    "off_part": {"checkpoints": CHECKPOINTS, "enable_offload": True, "enable_partition": True},
}


def strategy(case: str) -> fleet.DistributedStrategy:
    s = fleet_tp_worker.strategy(1, 2)
    if CASES[case]:
        s.recompute = True
        s.recompute_configs = CASES[case]
    return s


def body(program: metaopt.Program) -> metaopt.Program:
    """What the executor runs after the first run: the program without its startup ops."""
    q = program.clone()
    q.ops = [op for op in q.ops if not roles.is_startup(op.role)]
    return q


def run(case: str, exported: metaopt.Program) -> dict:
    program = exported.clone()
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=tp_worker.LR), strategy(case))
    opt.minimize(program.loss)
    exe = metaopt.Executor("cpu", record_timeline=True)
    losses = []
    for step in range(tp_worker.STEPS):
        (loss,) = exe.run(program, feed=tp_worker.batch(NAME, step), fetch_list=[program.loss])
        losses.append(float(loss))
    ran = body(program)
    dims = {"batch": tp_worker.BATCH}
    at = next(i for i, op in enumerate(ran.ops) if roles.is_backward(op.role))  # the forward is over
    report = opt.memory_report
    part = opt.context.plans.get("partition")
    return {
        "losses": losses,
        "params": {v.name: exe.scope[v.name].clone() for v in program.params()},
        "stats": exe.memory_stats(),
        "timeline": exe.memory_timeline(),
        "estimate": estimate_memory(ran, dims=dims, workspace=False).timeline,
        "first_backward": at,
        "held": {v.name: v.nbytes for v in where_alive(ran, at, dims=dims, workspace=False).vars},
        "report": None if report is None else dict(report.checkpoint_bytes),
        "report_batch": None if report is None else report.batch,
        "slices": {} if part is None else part.slices,
        "partition_plan": "" if part is None else str(part),
        "plan": str(opt.plan()),
        "ops": [f"{op.type} {op.role}" for op in program.ops],
    }


def main() -> None:
    out, dropout, cases = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    fleet.init(is_collective=True, strategy=fleet_tp_worker.strategy(1, 2))
    mod = programs.get(NAME)
    model = mod.build("tiny", seed=tp_worker.SEED, dropout=dropout)
    exported = export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name=NAME)
    for case in cases:
        metaopt.seed(1234)  # both RNG streams: every case draws the same masks (when dropout > 0)
        torch.save(run(case, exported), f"{out}/{case}.rank{fleet.worker_index()}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

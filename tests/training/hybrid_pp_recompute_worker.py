"""One worker of recompute (and recompute partition, offload) in a pipeline x tensor parallel job,
started by tests/training/test_hybrid_pipeline_partition.py with RANK/WORLD_SIZE/MASTER_*:
``python hybrid_pp_recompute_worker.py OUT SPEC [SPEC ...]``, each SPEC ``TAG:PROGRAM:CASE,CASE``.

MP=2 x PP=2 on 4 workers: hybrid_pp_worker's strategy (tensor parallel on tp_worker's gpt
column/row layers, a 1F1B pipeline cut at ``transformer.h.1``, 2 micro-batches) plus recompute
with fleet_tp_recompute_worker's checkpoints (``transformer.drop``, every block's output). Of
those, ``transformer.drop`` opens a recomputed segment on stage 0 and ``transformer.h.0``, the
value sent across the cut, opens one on stage 1 (the stage that receives it); ``transformer.h.1``
is the last (kept whole). PROGRAM is an export of the tiny GPT saved as ONNX by the test (4
workers exporting at once would dominate the test on a small machine).

CASE is one of fleet_tp_recompute_worker.CASES but ``tp`` (``rc`` recompute, ``part`` +
enable_partition, ``off`` + enable_offload, ``off_part`` + both), optionally with ``_auto``
(automatic cuts); each is seeded alike with ``metaopt.seed``, so every case draws the same
dropout masks. 3 SGD steps on tp_worker's full batches; writes ``OUT/<TAG>.<case>.rank<r>.pt``
with the losses, (local) params, the executor's memory stats and per-op timeline of the last
step, the estimate of the stage program at the micro-batch size, where the first micro-batch's
forward ends in both, and the plans."""

from __future__ import annotations

import sys

import fleet_tp_recompute_worker
import hybrid_pp_worker
import torch
import tp_worker

import metaopt
from metaopt import fleet
from metaopt.ir import roles
from metaopt.passes.memory_estimate import estimate_memory

NAME = hybrid_pp_worker.NAME
CASES = {k: v for k, v in fleet_tp_recompute_worker.CASES.items() if v}


def strategy(case: str) -> fleet.DistributedStrategy:
    """CASE's strategy; a case named ``<case>_auto`` cuts the pipeline where the balance puts it
    (pipeline_configs cuts [] = "auto": on the tiny GPT inside block 0, so a recomputed segment
    spans both stages and ``transformer.h.0`` is made on stage 1)."""
    base = case.removesuffix("_auto")
    s = hybrid_pp_worker.strategy(1, 2, 2)
    if base != case:
        s.pipeline_configs = {**s.pipeline_configs, "cuts": []}
    s.recompute = True
    s.recompute_configs = CASES[base]
    return s


def run(case: str, exported: metaopt.Program) -> dict:
    program = exported.clone()
    loss_name = program.loss.name  # the last stage's: fetched by name (stage 0 has no loss var)
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=tp_worker.LR), strategy(case))
    opt.minimize(program.loss)
    exe = metaopt.Executor("cpu", record_timeline=True)
    losses = []
    for step in range(tp_worker.STEPS):
        (loss,) = exe.run(program, feed=tp_worker.batch(NAME, step), fetch_list=[loss_name])
        losses.append(None if loss is None else float(loss))
    ran = fleet_tp_recompute_worker.body(program)  # the stage program less its startup ops
    micro = tp_worker.BATCH // hybrid_pp_worker.MICRO_BATCHES
    # The schedule runs micro-batch 0's forward first on every stage (1F1B), so the executor's
    # timeline entry after its last op is comparable with the estimate of the stage program
    # (forward ops first, in the same order) at the last forward op: the values held for the
    # backward are then the forward's carried-out values, and nothing of the backward is live.
    end_forward = max(i for i, op in enumerate(ran.ops) if roles.phase(op.role) == roles.FORWARD)
    return {
        "losses": losses,
        "params": {v.name: exe.scope[v.name].clone() for v in program.params()},
        "stats": exe.memory_stats(),
        "timeline": exe.memory_timeline(),
        "estimate": estimate_memory(ran, dims={"batch": micro}, workspace=False).timeline,
        "end_forward": end_forward,
        "stage": program.pipeline.stage,
        "slices": {} if opt.partition_plan is None else opt.partition_plan.slices,
        "partition_plan": str(opt.partition_plan),
        "pipeline_plan": str(opt.pipeline_plan),
        "var_bytes": {v.name: v.nbytes({"batch": micro}) for v in ran.vars.values()},
        "ops": [f"{op.type} {op.role}" for op in ran.ops],
    }


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    fleet.init(is_collective=True, strategy=hybrid_pp_worker.strategy(1, 2, 2))
    for spec in specs:
        tag, path, cases = spec.split(":")
        exported = metaopt.load(path)
        for case in cases.split(","):
            metaopt.seed(1234)  # both RNG streams: every case draws the same masks (when dropout > 0)
            torch.save(run(case, exported), f"{out}/{tag}.{case}.rank{fleet.worker_index()}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

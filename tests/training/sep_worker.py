"""One worker of segment or context parallel through fleet (started by
tests/passes/test_segment_parallel.py and test_context_parallel.py with RANK/WORLD_SIZE/MASTER_*):
``python sep_worker.py OUT DP SEP CASE ...``, SEP = ``2`` (sep_degree), ``cp2`` (cp_degree), or cp
beside another axis: ``cp2xmp2`` (tensor parallel's mp_degree), ``cp2xzero<stage>`` (ZeRO over
sharding_degree 2, each sharding rank fed half the batch), ``cp2xpp2`` (a pipeline of 2 stages, 2
micro-batches, every worker fed the whole batch, the loss on the last stage), CASE =
``<model>[:rc|:nodrop|:amp|:misfed]`` (rc: recompute, a checkpoint per block; nodrop: every dropout
off, else 0.1; amp: bfloat16 AMP; misfed: each sep rank fed another batch, which the first run must
refuse).

fleet.init lays the DP x SEP workers out (``hybrid_configs`` dp_degree, sep_degree); every sep rank
of a replica is fed the replica's whole share of the step's batch (each keeps its chunk of every
sequence). 3 SGD steps from `metaopt.seed(SEED)`; writes the losses, the params (whole on every
rank), the plan, the program and the memory (measured and predicted) to ``OUT/<case>.rank<r>.pt``.
"""

from __future__ import annotations

import sys

import export_cache
import sp_worker
import torch
import tp_worker

import metaopt
from metaopt import fleet


def strategy(
    dp: int, sep: str, name: str = "hf-gpt2", recompute: bool = False, amp: bool = False
) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    seq, _, mp = sep.partition("xmp")
    seq, _, zero = seq.partition("xzero")
    seq, _, pp = seq.partition("xpp")
    if pp:  # a pipeline of `pp` stages, 2 micro-batches (1F1B), every worker fed the whole batch
        s.pipeline = True
        s.pipeline_configs = {"accumulate_steps": 2, "micro_batch_size": None}
    key = "cp_degree" if seq.startswith("cp") else "sep_degree"
    degrees = {key: int(seq.removeprefix("cp")), "mp_degree": int(mp or 1), "pp_degree": int(pp or 1)}
    s.hybrid_configs = {"dp_degree": dp, **degrees}
    if zero:  # ZeRO at stage `zero` over 2 data-side workers (sharding_degree), each its half batch
        s.hybrid_configs = {**s.hybrid_configs, "sharding_degree": 2}
        s.sharding = True
        s.sharding_configs = {"stage": int(zero)}
    if mp:  # tensor parallel beside it, attention dropout one process's mask over the heads
        s.tensor_parallel = True
        s.tensor_parallel_configs = {
            "column": tp_worker.COLUMN[name],
            "row": tp_worker.ROW[name],
            "one_process_dropout": True,
        }
    return sp_worker.with_amp_and_recompute(s, name, amp, recompute)


def train_pipeline(case: str, sep: str) -> dict:
    """The losses of 3 steps at a pipeline beside the sequence split (fetched on the last stage)."""
    name = case.partition(":")[0]
    module, inputs, kwargs = sp_worker.build(name, 0.0)
    program = export_cache.export(module, inputs, **kwargs)
    opt = fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=tp_worker.LR), strategy(1, sep, name)
    )
    opt.minimize(program.loss)
    hcg = fleet.get_hybrid_communicate_group()
    last = hcg.get_stage_id() == hcg.get_pipe_parallel_world_size() - 1
    metaopt.seed(sp_worker.SEED)
    exe, losses = metaopt.Executor("cpu"), []
    for step in range(tp_worker.STEPS):
        got = exe.run(program, feed=sp_worker.batch(name, step), fetch_list=[program.loss] if last else [])
        losses.append(float(got[0]) if last else None)
    return {"losses": losses, "stage": hcg.get_stage_id(), "sep_rank": hcg.get_sep_parallel_rank()}


def train(case: str, dp: int, sep: str) -> dict:
    name, _, mode = case.partition(":")
    module, inputs, kwargs = sp_worker.build(name, 0.0 if mode == "nodrop" else sp_worker.DROPOUT)
    program = export_cache.export(module, inputs, **kwargs)
    opt = fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=tp_worker.LR),
        strategy(dp, sep, name, mode == "rc", mode == "amp"),
    )
    opt.minimize(program.loss)
    hcg = fleet.get_hybrid_communicate_group()
    feeds = [
        sp_worker.replica_batch(
            name, step, sp_worker.data_side_rank(hcg), dp * hcg.get_sharding_parallel_world_size()
        )
        for step in range(tp_worker.STEPS)
    ]
    _, got = sp_worker.run_steps(program, feeds, sp_worker.batch(name, sp_worker.HELD_OUT))
    return {
        **got,
        "plan": str(opt.context_parallel_plan if sep.startswith("cp") else opt.segment_parallel_plan),
        "sep_rank": hcg.get_sep_parallel_rank(),
        "mp_rank": hcg.get_model_parallel_rank(),
        "splits": {sp.name: (sp.axis, sp.blocks) for sp in opt.tensor_parallel_plan.params}
        if opt.tensor_parallel_plan is not None
        else {},
        "dp_rank": hcg.get_data_parallel_rank(),
    }


def misfed(case: str, dp: int, sep: str) -> dict:
    """Each sep rank fed its own batch (the step's + its sep rank): the first run must refuse."""
    name = case.partition(":")[0]
    module, inputs, kwargs = sp_worker.build(name, 0.0)
    program = export_cache.export(module, inputs, **kwargs)
    fleet.distributed_optimizer(
        metaopt.optimizer.SGD(learning_rate=tp_worker.LR), strategy(dp, sep)
    ).minimize(program.loss)
    hcg = fleet.get_hybrid_communicate_group()
    feed = sp_worker.replica_batch(name, hcg.get_sep_parallel_rank(), hcg.get_data_parallel_rank(), dp)
    try:
        metaopt.Executor("cpu").run(program, feed=feed, fetch_list=[program.loss])
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def main() -> None:
    out, dp, sep, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    fleet.init(is_collective=True, strategy=strategy(dp, sep))
    for case in cases:
        if case.endswith(":misfed"):
            got = misfed(case, dp, sep)
        elif "xpp" in sep:
            got = train_pipeline(case, sep)
        else:
            got = train(case, dp, sep)
        torch.save(got, f"{out}/{case.replace(':', '.')}.rank{fleet.worker_index()}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

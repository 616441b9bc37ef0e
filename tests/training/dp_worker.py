"""One data-parallel worker (started by test_data_parallel.py with RANK/WORLD_SIZE/MASTER_*).

For each case ("name:recompute"), builds its model with a seed of its own rank (so only
rank 0's initial values are right: the meta optimizer must broadcast them), trains 5
Adam steps on its share of each full batch and writes losses and params to
`<out>/<case>.rank<r>.pt`.
"""

from __future__ import annotations

import dataclasses
import sys

import export_cache
import torch

import metaopt
import programs
from metaopt import fleet

STEPS = 5
BATCH = 8  # the full batch; each worker takes its contiguous share


def full_batch(name: str, step: int) -> tuple[torch.Tensor, ...]:
    """The step's full batch. BERT's MLM loss is a mean over the target tokens of the
    batch, so data parallel equals one big batch only when every worker's share has as
    many targets (true of DDP too): here each sequence has its first 3 real tokens as
    targets (every sequence has at least seq_len/2 real tokens)."""
    mod = programs.get(name)
    batch = mod.example_inputs("tiny", BATCH, seed=step)
    if name != "bert":
        return batch
    input_ids, token_type_ids, attention_mask, _, nsp = batch
    targets = (torch.arange(input_ids.shape[1]) >= 1) & (torch.arange(input_ids.shape[1]) <= 3)
    mlm = torch.where(targets.expand_as(input_ids), input_ids, torch.full_like(input_ids, -100))
    return input_ids, token_type_ids, attention_mask, mlm, nsp


def train_case(name: str, mode: str, rank: int, world: int) -> dict:
    mod = programs.get(name)
    model = mod.build("tiny", seed=100 + rank, dropout=0.0)
    main = export_cache.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)
    strategy = fleet.DistributedStrategy()
    if name == "mlp" or mode == "early":  # early: each update can follow its own grad's all-reduce
        strategy.fuse_all_reduce_ops = False  # one AllReduce per grad
    else:
        strategy.fuse_grad_size_in_MB = 1  # fused buckets
    if mode in ("recompute", "offload"):
        strategy.recompute = True
        strategy.recompute_configs = {"checkpoints": CHECKPOINTS[name], "enable_offload": mode == "offload"}
    strategy.optimizer_in_backward = mode == "early"  # updates right after their bucket's all-reduce
    k = MERGE_K if mode == "merge" else 1
    if mode == "merge":  # each worker's share in k runs, one update per k runs
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": k, "avg": True}
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), strategy)
    opt.minimize(main.loss)
    assert opt.applied_meta_list[-1] == "data_parallel", opt.applied_meta_list
    if mode == "sync":  # every all-reduce waited for where it starts: what overlap_comm must equal
        main.ops = [
            dataclasses.replace(op, attrs={k: v for k, v in op.attrs.items() if k != "overlap"})
            for op in main.ops
            if op.type != "CommWait"
        ]
    exe = metaopt.Executor("cpu")
    reduces = _count_all_reduces(exe)
    share = BATCH // world
    losses = []
    for step in range(STEPS):
        full = full_batch(name, step)
        part = [x[rank * share : (rank + 1) * share] for x in full]
        run_losses = []
        for j in range(k):
            micro = [x[j * share // k : (j + 1) * share // k] for x in part]
            feed = dict(zip(mod.INPUT_NAMES, micro, strict=True))
            (loss,) = exe.run(main, feed=feed, fetch_list=[main.loss])
            run_losses.append(float(loss))
        losses.append(sum(run_losses) / k)
    params = {v.name: exe.scope[v.name].clone() for v in main.params()}
    copies = sum(op.type == "Memcpy" for op in main.ops)
    return {
        "losses": losses,
        "params": params,
        "buckets": len(opt.data_parallel_plan.buckets),
        "copies": copies,
        "early_updates": sum(op.role == "backward-update" for op in main.ops),
        "offloaded_bytes": exe.memory_stats()["offloaded_bytes"],
        "all_reduce_calls": reduces[0],
        "overlapped": sum(bool(op.attrs.get("overlap")) for op in main.ops),
    }


def _count_all_reduces(exe) -> list[int]:
    """Count this executor's all-reduce calls (one per fused bucket and run)."""
    count = [0]
    comm = exe.runtime.comm
    real = comm.all_reduce

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    comm.all_reduce = counted
    return count


CHECKPOINTS = {"mlp": ["fc1", "fc2"], "bert": ["bert.encoder.layer.*"]}
MERGE_K = 2  # gradient merge: each worker's share of a step in 2 runs


def single_process(name: str) -> dict:
    """What the workers must equal: one process, the full batch, rank 0's initial values, no
    recompute (which is bit-identical); fleet initialised (one worker) and reset around it."""
    from metaopt.fleet import env

    env.reset()
    fleet.init()
    try:
        mod = programs.get(name)
        model = mod.build("tiny", seed=100, dropout=0.0)  # rank 0's initial values
        main = metaopt.export(model, mod.example_inputs("tiny", 4, seed=1), name=name)
        strategy = fleet.DistributedStrategy()
        fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), strategy).minimize(main.loss)
        exe = metaopt.Executor("cpu")
        losses = []
        for step in range(STEPS):
            full = full_batch(name, step)
            (loss,) = exe.run(
                main, feed=dict(zip(mod.INPUT_NAMES, full, strict=True)), fetch_list=[main.loss]
            )
            losses.append(float(loss))
        return {"losses": losses, "params": {v.name: exe.scope[v.name] for v in main.params()}}
    finally:
        env.reset()


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    for case in cases:
        name, mode = case.split(":")
        result = train_case(name, mode, rank, world)
        torch.save(result, f"{out}/{case}.rank{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

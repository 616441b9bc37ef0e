"""One worker of tensor parallel through fleet (started by tests/fleet/test_fleet_tensor_parallel.py
with RANK/WORLD_SIZE/MASTER_*): ``python fleet_tp_worker.py OUT DP MP [SHARDING [STAGE:OPT ...]]``.

fleet.init lays the DP x MP (x SHARDING) workers out from hybrid_configs; the optimizer's strategy
turns on tensor parallel with tp_worker's gpt column/row layers (and ZeRO sharding at STAGE over
the sharding axis). Each data-parallel replica (a sharding rank is one too) is fed its share of
tp_worker's full batch, every MP rank of a replica the same share. 3 steps of each OPT at its
sharding STAGE ("sgd", the default; "adam"; "adam-save": Adam, then save_persistables into
OUT/ckpt<STAGE>; "adam-load": no steps, what load_persistables of it gives this worker; "sgd-meta":
SGD on the module built on meta, filled by fleet.load_pretrained from $PRETRAINED; "sgd-init": the
same, made by fleet.init_from_module, the values it starts from saved into OUT/gpt.sgd-init.init by
fleet.save_pretrained); writes its
losses, (local) params, held state and plans to ``OUT/gpt[.STAGE:OPT].rank<r>.pt``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import export_cache
import torch
import tp_worker
from training_cases import HELD_OUT, INIT_SEED, _module, evaluate, pretrained_path
from workers import gathered_params

import metaopt
from metaopt import fleet

NAME = "gpt"


def strategy(dp: int, mp: int, sharding: int = 1, stage: int = 1) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": dp, "mp_degree": mp, "sharding_degree": sharding}
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"column": tp_worker.COLUMN[NAME], "row": tp_worker.ROW[NAME]}
    if sharding == 1:  # a data-parallel all-reduce per grad: all but the last left in flight
        s.fuse_all_reduce_ops = False
    if sharding > 1:
        s.sharding = True
        s.sharding_configs = {"stage": stage, "segment_broadcast_MB": 0.01}
    return s


def replica_batch(step: int, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """This replica's contiguous 1/dp of the step's full batch."""
    full = tp_worker.batch(NAME, step)
    n = tp_worker.BATCH // dp
    return {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in full.items()}


def train(s: fleet.DistributedStrategy, opt: str, ckpt: str, out: str) -> dict:
    hcg = fleet.get_hybrid_communicate_group()
    sh = hcg.get_sharding_parallel_world_size()
    replica = hcg.get_data_parallel_rank() * sh + hcg.get_sharding_parallel_rank()
    meta = opt.endswith("-meta")
    module = None
    if opt.endswith("-init"):
        module, inputs, kwargs = _module(NAME, meta=True)
        program = export_cache.export(module, inputs, **kwargs)
    else:
        program = tp_worker.export(NAME, meta=meta)
    optimizer = (
        metaopt.optimizer.SGD(learning_rate=tp_worker.LR)
        if opt in ("sgd", "sgd-meta", "sgd-init")
        else metaopt.optimizer.Adam(learning_rate=1e-2)
    )
    opt_ = fleet.distributed_optimizer(optimizer, s)
    opt_.minimize(program.loss)
    exe = metaopt.Executor("cpu")
    if meta:  # no values until this worker reads its slices of its part of each tensor
        fleet.load_pretrained(exe, program, pretrained_path(Path(os.environ["PRETRAINED"]), NAME))
    if module is not None:  # this worker's ZeRO run of its tensor-parallel part, made here
        fleet.init_from_module(exe, program, module, seed=INIT_SEED)
        fleet.save_pretrained(exe, program, f"{out}/{NAME}.{opt}.init")
    losses = []
    if opt.endswith("-load"):  # what this worker holds of OUT/ckpt, untrained
        fleet.load_persistables(exe, ckpt, program)
    for step in range(0 if opt.endswith("-load") else tp_worker.STEPS):
        feed = replica_batch(step, replica, hcg.get_data_parallel_world_size() * sh)
        (loss,) = exe.run(program, feed=feed, fetch_list=[program.loss])
        losses.append(float(loss))
    if opt.endswith("-save"):
        fleet.save_persistables(exe, ckpt, program)
    # issue 49: the eval program of the layout, the whole held-out batch on every replica
    evals = evaluate(exe, program, tp_worker.batch(NAME, HELD_OUT), program.loss_name)
    return {
        "losses": losses,
        "eval": evals,
        "params": gathered_params(exe, program),
        "held": {n: exe.scope[n].clone() for n in _state(program)},
        "layouts": {v.name: (str(v.split), str(v.zero)) for v in program.vars.values() if v.persistable},
        "applied": list(opt_.applied_meta_list),
        "plan": str(opt_.plan()),
        "dp_plan": str(opt_.data_parallel_plan),
        "program": str(program),
        "ops": [
            f"{op.type} {sorted(op.attrs.items())}" for op in program.ops if op.role in ("comm", "startup")
        ],
        "dp_rank": hcg.get_data_parallel_rank(),
        "mp_rank": hcg.get_model_parallel_rank(),
        "sharding_rank": hcg.get_sharding_parallel_rank(),
    }


def _state(program: metaopt.Program) -> list[str]:
    """The shaped optimizer state (the Adam moments: not the step counter)."""
    return [v.name for v in program.vars.values() if v.kind == "opt_state" and v.shape]


def main() -> None:
    out, dp, mp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rest = sys.argv[4:]  # [SHARDING [STAGE:OPT ...]]
    sharding = int(rest[0]) if rest else 1
    fleet.init(is_collective=True, strategy=strategy(dp, mp, sharding))
    for token in rest[1:] or ["sgd"]:
        stage, _, opt = token.rpartition(":")
        s = strategy(dp, mp, sharding, int(stage or 1))
        suffix = "" if token == "sgd" else f".{token}"
        result = train(s, opt, f"{out}/ckpt{stage}", out)
        torch.save(result, f"{out}/{NAME}{suffix}.rank{fleet.worker_index()}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()

"""One hybrid-parallel worker (started by test_hybrid_topology.py with RANK/WORLD_SIZE/MASTER_*).

argv: out dir, then layouts "dp,mp,pp[,order]" (order: a key of ORDERS). For each layout, in
order (every worker alike):
``fleet.init`` with those hybrid_configs, then record what ``fleet.get_hybrid_communicate_group()``
says (ranks, sizes, src ranks) and, for each axis, the all_reduce (sum) of this worker's rank over
its group and of a 1 (the group's size). Then: with pp > 1, train two SGD steps of a tiny program
as a pipeline laid out by the hybrid degrees (stage, replicas, loss, params); with mp > 1,
minimize's refusal. Last, a world size that does not fit is refused at fleet.init. Writes
``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import metaopt
from metaopt import fleet
from metaopt.ir import Op, Program, Var


def _program() -> Program:
    p = Program("tiny")
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    p.add_var(Var("w", "float32", (4, 3), "param", trainable=True), torch.arange(12.0).reshape(4, 3) / 10)
    p.add_var(Var("h", "float32", ("batch", 3)))
    p.add_var(Var("a", "float32", ("batch", 3)))
    p.add_var(Var("v", "float32", (3, 2), "param", trainable=True), torch.ones(3, 2) / 3)
    p.add_var(Var("y", "float32", ("batch", 2)))
    p.add_var(Var("loss", "float32", ()))
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    p.ops = [
        Op("MatMul", ["x", "w"], ["h"]),
        Op("Relu", ["h"], ["a"]),
        Op("MatMul", ["a", "v"], ["y"]),
        Op("ReduceMean", ["y"], ["loss"], {"keepdims": 0}, role="loss"),
    ]
    return p


ORDERS = {"mp-first": ["mp", "pp", "sharding", "dp"]}  # a layout's optional 4th field: Paddle's order


def _strategy(dp: int, mp: int, pp: int, order: str = "") -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {
        "dp_degree": dp,
        "mp_degree": mp,
        "pp_degree": pp,
        **({"order": ORDERS[order]} if order else {}),
    }
    return s


def _sums(hcg) -> dict:
    """Per axis: (sum of the members' ranks, member count), by all_reduce over the group."""
    out = {}
    for axis, group in [
        ("data", hcg.get_data_parallel_group()),
        ("model", hcg.get_model_parallel_group()),
        ("pipe", hcg.get_pipe_parallel_group()),
        ("sharding", hcg.get_sharding_parallel_group()),
    ]:
        t = torch.tensor([float(hcg.get_global_rank()), 1.0])
        dist.all_reduce(t, group=group)
        out[axis] = [int(t[0]), int(t[1])]
    return out


def _pipeline(dp: int, pp: int) -> dict:
    s = _strategy(dp, 1, pp)
    s.pipeline = True
    s.pipeline_configs = {"cuts": ["a"], "accumulate_steps": 2}
    main = _program()
    fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s).minimize(main.loss)
    exe = metaopt.Executor("cpu")
    losses = []
    for step in range(2):
        replica = fleet.get_hybrid_communicate_group().get_data_parallel_rank()
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + replica))
        (loss,) = exe.run(main, feed={"x": x}, fetch_list=["loss"])
        losses.append(None if loss is None else float(loss))
    info = main.pipeline
    params = {v.name: exe.scope[v.name].flatten().tolist() for v in main.params()}
    return {
        "stage": info.stage,
        "num_stages": info.num_stages,
        "dp_degree": info.dp_degree,
        "losses": losses,
        "params": params,
    }


def _layout(dp: int, mp: int, pp: int, order: str = "") -> dict:
    fleet.init(is_collective=True, strategy=_strategy(dp, mp, pp, order))
    hcg = fleet.get_hybrid_communicate_group()
    rec = {
        "global_rank": hcg.get_global_rank(),
        "dp": [hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size()],
        "mp": [hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()],
        "pp": [hcg.get_stage_id(), hcg.get_pipe_parallel_world_size()],
        "sharding": [hcg.get_sharding_parallel_rank(), hcg.get_sharding_parallel_world_size()],
        "src": [hcg.get_data_parallel_group_src_rank(), hcg.get_model_parallel_group_src_rank()],
        "groups": {a: hcg.group_ranks(a) for a in ("data", "model", "pipe", "sharding")},
        "sums": _sums(hcg),
    }
    if mp > 1:
        try:
            fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1)).minimize(_program().loss)
            rec["refused"] = None
        except (NotImplementedError, ValueError) as e:  # mp_degree without strategy.tensor_parallel
            rec["refused"] = str(e)
    elif pp > 1:
        rec["pipeline"] = _pipeline(dp, pp)
    return rec


def main() -> None:
    out, layouts = sys.argv[1], sys.argv[2:]
    result: dict = {}
    for layout in layouts:
        dp, mp, pp, *order = layout.split(",")
        result[layout] = _layout(int(dp), int(mp), int(pp), *order)
    try:  # 2 x 2 x 2 on 4 workers: refused by every worker alike, before any group is made
        fleet.init(is_collective=True, strategy=_strategy(2, 2, 2))
        result["wrong_world"] = None
    except ValueError as e:
        result["wrong_world"] = str(e)
    fleet.barrier_worker()
    with open(f"{out}/rank{fleet.worker_index()}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

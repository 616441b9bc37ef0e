"""fp16_allreduce (Fleet's strategy.fp16_allreduce): the all-reduces of data parallel's float32
buckets send float16. The arithmetic on two gloo workers (the sum is the two workers' halves in
float16, bit for bit): tests/training/test_sharding_workers.py."""

from __future__ import annotations

import re

import pytest
from conftest import exported

import metaopt
from metaopt import fleet
from metaopt.ir import names, parse_program, print_program, verify
from metaopt.passes.data_parallel import data_parallel
from metaopt.passes.fp16_allreduce import Fp16AllReduceError, apply_fp16_allreduce, plan_fp16_allreduce
from metaopt.passes.optimize import update_grads


def _dp(scatter: int | None = None) -> metaopt.Program:
    p = exported("mlp")[2].clone()
    metaopt.optimizer.SGD(0.1).minimize(p.loss)
    grads = update_grads(p)
    return data_parallel(p, grads=grads, world_size=2, bucket_bytes=1 << 20, scatter_parts=scatter), grads


def test_the_buckets_all_reduce_in_float16_and_the_program_reads_back(golden):
    p, grads = _dp()
    plan = plan_fp16_allreduce(p, reduced=[names.reduced(g) for g in grads])
    q = apply_fp16_allreduce(p, plan)
    verify(q)
    (op,) = [op for op in q.ops if op.attrs.get("comm_dtype") == "float16"]
    assert (
        op.type == "AllReduce"
        and len(op.inputs) == len(grads)
        and "fp16_allreduce: 1 all-reduce" in str(plan)
    )
    assert print_program(parse_program(print_program(q))) == print_program(q)
    golden("fp16_allreduce/mlp", print_program(q))


def test_narrow_grads_are_skipped_and_a_reduce_scatter_is_refused():
    p, grads = _dp()
    for g in grads:
        p.vars[names.reduced(g)] = p.vars[names.reduced(g)].copy(dtype="bfloat16")
    plan = plan_fp16_allreduce(p, reduced=[names.reduced(g) for g in grads])
    assert plan.ops == [] and all(why == "bfloat16 already" for _, why in plan.skipped)
    p, grads = _dp(scatter=2)
    with pytest.raises(Fp16AllReduceError, match="made by ReduceScatter, which sends its own dtype"):
        plan_fp16_allreduce(p, reduced=[names.reduced(grads[0])])


def test_one_worker_skips_the_step_and_says_why():
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    s.fp16_allreduce = True
    main = exported("mlp")[2].clone()
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), s)
    row = r"fp16_allreduce +skip +strategy.fp16_allreduce=True but no data parallel"
    assert re.search(row, str(opt.plan(main.loss)))
    opt.minimize(main.loss)
    assert "fp16_allreduce" not in opt.applied_meta_list

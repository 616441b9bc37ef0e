"""passes/overlap_comm.py: each bucket's all-reduce left in flight until its first reader.

The numerics (an overlapped run is the same bits as one waiting where the all-reduce starts) are
tested on two workers in tests/training/test_data_parallel.py (`mlp:sync`); here, the placement."""

from __future__ import annotations

import dataclasses

import pytest

import metaopt
import programs
from metaopt.ir import roles
from metaopt.ops.in_flight import InFlightError, check_in_flight
from metaopt.passes.data_parallel import data_parallel
from metaopt.passes.overlap_comm import apply_overlap_comm, plan_overlap_comm


def _reduced_mlp(**dp) -> metaopt.Program:
    mod = programs.get("mlp")
    main = metaopt.export(mod.build("tiny", seed=0), mod.example_inputs("tiny", 4, seed=1), name="mlp")
    _, pg = metaopt.optimizer.SGD(learning_rate=1e-3).minimize(main.loss)
    return data_parallel(main, grads=[g for _, g in pg], world_size=2, bucket_bytes=0, **dp)


def test_each_wait_comes_right_before_the_first_reader_of_its_outputs():
    p = _reduced_mlp()
    plan = plan_overlap_comm(p)
    q = apply_overlap_comm(p, plan)
    metaopt.verify(q)
    starts = [i for i, op in enumerate(q.ops) if op.attrs.get("overlap")]
    # 6 grads, a bucket each; the last one's updates follow it at once
    assert len(starts) == len(plan.overlaps) == 5
    assert plan.skipped == [("fc1.bias@GRAD@REDUCED", "read by the next op: nothing to overlap")]
    for i in starts:
        outs = q.ops[i].outputs
        (w,) = [j for j, op in enumerate(q.ops) if op.type == "CommWait" and op.inputs == outs]
        first = min(j for j, op in enumerate(q.ops) if j != w and set(op.inputs) & set(outs))
        # right before the first reader, or before the run of updates it is in
        between = q.ops[w:first]
        assert i < w < first and all(op.type == "CommWait" or roles.is_update(op.role) for op in between)
    # the backward went on while the first buckets travelled
    assert any(op.role == "backward" for op in q.ops[starts[0] + 1 : starts[-1]])
    assert str(plan).startswith("overlap_comm: 5 collective(s) left in flight")
    # the updates stay one run: the executor makes consecutive updates one multi-tensor call
    updates = [j for j, op in enumerate(q.ops) if op.role == "optimize"]
    assert updates == list(range(updates[0], updates[-1] + 1)) and len(updates) == 6
    # a second application leaves what is in flight as it is
    again = plan_overlap_comm(q)
    assert not again.overlaps and len(again.skipped) == 6
    assert sum(why == "left in flight already" for _, why in again.skipped) == 5


def test_overlap_comm_golden(golden):
    p = _reduced_mlp()
    golden("overlap_comm/mlp", str(apply_overlap_comm(p, plan_overlap_comm(p))))


def test_a_collective_not_of_role_comm_or_sending_float16_is_left_where_it_is():
    """AMP's found-inf sum (role optimize) is placed where its value is needed."""
    p = _reduced_mlp()
    k = next(i for i, op in enumerate(p.ops) if op.type == "AllReduce")
    p.ops[k] = dataclasses.replace(p.ops[k], role="optimize")
    plan = plan_overlap_comm(p)
    assert (p.ops[k].outputs[0], "role optimize: placed where its value is needed") in plan.skipped
    assert k not in [o.start for o in plan.overlaps] and len(plan.overlaps) == 4
    # fp16_allreduce's narrow copy would live, unaccounted, from the start to the wait
    j = next(i for i, op in enumerate(p.ops) if op.type == "AllReduce" and i != k)
    p.ops[j] = dataclasses.replace(p.ops[j], attrs={**p.ops[j].attrs, "comm_dtype": "float16"})
    assert any(g == p.ops[j].outputs[0] and "another dtype" in why for g, why in plan_overlap_comm(p).skipped)


def test_a_reader_before_the_wait_or_a_missing_wait_is_refused_naming_the_op():
    p = _reduced_mlp()
    q = apply_overlap_comm(p, plan_overlap_comm(p))
    w = next(i for i, op in enumerate(q.ops) if op.type == "CommWait")
    reader = next(i for i, op in enumerate(q.ops) if i > w and set(op.inputs) & set(q.ops[w].inputs))
    early = q.clone()
    early.ops = [*q.ops[:w], q.ops[reader], *q.ops[w:reader], *q.ops[reader + 1 :]]
    with pytest.raises(InFlightError, match=r"reads .* before the wait of the collective in flight"):
        check_in_flight(early)
    with pytest.raises(InFlightError, match="before the wait"):  # the executor checks what it plans
        metaopt.Executor("cpu").plan_source(early)
    missing = q.clone()
    missing.ops = q.ops[:w]
    with pytest.raises(InFlightError, match="never waited for"):
        check_in_flight(missing)
    stray = q.clone()  # a wait of values no collective left in flight
    stray.ops = [dataclasses.replace(op, attrs={}) if op.attrs.get("overlap") else op for op in q.ops]
    with pytest.raises(InFlightError, match="waits for no collective in flight"):
        check_in_flight(stray)
    partial = q.clone()  # a wait over some of the outputs only is no wait of that collective
    partial.ops = list(q.ops)
    partial.ops[w] = dataclasses.replace(q.ops[w], inputs=q.ops[w].inputs[:0])
    with pytest.raises(InFlightError):
        check_in_flight(partial)


def test_a_reduce_scatter_holds_its_rows_as_an_output_and_one_bucket_is_in_flight():
    """ZeRO stage 2: the rows a reduce-scatter sends (the bucket's whole grads) live until its
    wait, so they are an output (``g@STAGED``) the wait frees, and each is waited for before the
    next collective starts."""
    p = _reduced_mlp(scatter_parts=2)
    plan = plan_overlap_comm(p)
    q = apply_overlap_comm(p, plan)
    metaopt.verify(q)
    starts = [i for i, op in enumerate(q.ops) if op.attrs.get("overlap")]
    assert len(starts) == 5 and all(o.staged for o in plan.overlaps)
    for i in starts:
        op = q.ops[i]
        staged = op.outputs[-1]
        assert staged == f"{op.inputs[0]}@STAGED"
        slices = sum(q.vars[o].shape[0] for o in op.outputs[:-1])
        assert q.vars[staged].shape == (2, slices) and q.vars[staged].dtype == q.vars[op.inputs[0]].dtype
        (w,) = [j for j, x in enumerate(q.ops) if x.type == "CommWait" and x.inputs == op.outputs]
        later = [j for j in starts if j > i]
        assert w < (later[0] if later else len(q.ops))  # waited for before the next one starts
        assert [j for j, x in enumerate(q.ops) if staged in x.inputs] == [w]  # the wait frees it
    assert "holding fc3.weight@GRAD@STAGED until then" in str(plan)

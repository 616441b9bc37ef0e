"""estimate_memory's per-op timeline and its `where` view, against the executor's own count."""

from __future__ import annotations

import functools
import warnings

import pytest
from conftest import exported

import metaopt
import programs
from metaopt import fleet
from metaopt.ir.liveness import liveness
from metaopt.passes.memory_estimate import estimate_memory, where_alive

CHECKPOINTS = {"mlp": ["fc1", "fc2"], "bert": ["bert.encoder.layer.*"]}


@functools.cache
def fleet_program(name: str, strategy: str, optimizer: str = "adam") -> metaopt.Program:
    """A tiny reference program trained through fleet: strategy none / recompute / offload
    (recompute + offload), dropout 0.1."""
    _, _, program = exported(name, dropout=0.1)
    main = program.clone()
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    if strategy != "none":
        s.recompute = True
        s.recompute_configs = {"checkpoints": CHECKPOINTS[name], "enable_offload": strategy == "offload"}
    if optimizer == "adam":
        opt = metaopt.optimizer.Adam(learning_rate=1e-3)
    else:
        opt = metaopt.optimizer.SGD(learning_rate=0.1)
    with warnings.catch_warnings():  # mlp's checkpoints save nothing: recompute says so
        warnings.simplefilter("ignore", UserWarning)
        fleet.distributed_optimizer(opt, s).minimize(main.loss)
    return main


def feed_of(name: str, batch: int) -> dict:
    mod = programs.get(name)
    return dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", batch, seed=1), strict=True))


def measured(program: metaopt.Program, feed: dict) -> tuple[list[int], dict]:
    exe = metaopt.Executor("cpu", record_timeline=True)
    exe.run(program, feed=feed, fetch_list=[program.loss])
    return exe.memory_timeline(), exe.memory_stats()


@pytest.mark.parametrize("strategy", ["none", "recompute", "offload"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_timeline_is_the_executors_count_at_every_op(strategy, optimizer):
    """mlp: every op's row describes its storage, so the estimate is exact op by op; Adam's
    step counter is replaced, not written in place (the old value goes at the update)."""
    p = fleet_program("mlp", strategy, optimizer)
    timeline, stats = measured(p, feed_of("mlp", 8))
    est = estimate_memory(p, dims={"batch": 8}, workspace=False)
    assert est.timeline == timeline
    assert est.peak_bytes == stats["peak_bytes"] == max(timeline)
    assert est.timeline[est.peak_op] == est.peak_bytes


def test_where_names_what_is_alive_at_the_peak():
    p = fleet_program("bert", "offload")
    est = estimate_memory(p, dims={"batch": 4}, workspace=False)
    where = est.where
    assert where.op == est.peak_op >= 0
    assert where.total_bytes == est.peak_bytes == sum(v.nbytes for v in where.vars)
    assert sum(where.by_role().values()) == where.total_bytes
    assert [v.nbytes for v in where.vars] == sorted((v.nbytes for v in where.vars), reverse=True)
    names = {v.name for v in where.vars} | {x for v in where.vars for x in v.views}
    op = p.ops[where.op]
    # the peak op's inputs and outputs are alive at it, and so is all the state
    assert {x for x in (*op.inputs, *op.outputs) if x} <= names
    assert {v.name for v in p.persistables() if v.nbytes()} <= names
    # nothing listed is dead: each storage was made at or before the op, and it or a view of
    # it is read at or after it
    last, _ = liveness(p, [p.loss_name])
    made = {o: i for i, o_ in enumerate(p.ops) for o in o_.outputs if o}
    for v in where.vars:
        if v.op >= 0:
            assert made[v.name] == v.op <= where.op <= max(last[x] for x in (v.name, *v.views)), v
            assert v.role == p.ops[v.op].role
        else:
            assert v.role == p.vars[v.name].kind
    text = str(where)
    assert f"op {where.op}:" in text and where.vars[0].name in text and "by role:" in text


def test_where_alive_at_any_op_and_errors():
    p = fleet_program("mlp", "none")
    est = estimate_memory(p, dims={"batch": 8})
    for at in (0, est.peak_op, len(p.ops) - 1):
        w = where_alive(p, at, dims={"batch": 8})
        assert w.op == at and w.total_bytes == est.timeline[at]
    start = where_alive(p, -1, dims={"batch": 8})
    assert start.op == -1 and "before the first op" in str(start)
    with pytest.raises(IndexError, match=rf"op index {len(p.ops)} is outside program 'mlp'"):
        where_alive(p, len(p.ops), dims={"batch": 8})


def test_offloaded_copies_are_host_bytes_in_the_where_view():
    p = fleet_program("bert", "offload")
    copy = next(i for i, op in enumerate(p.ops) if op.role == "offload")
    w = where_alive(p, copy, dims={"batch": 4}, workspace=False)
    moved = p.vars[p.ops[copy].inputs[0]].nbytes({"batch": 4})
    assert w.host_bytes == moved > 0
    assert p.ops[copy].outputs[0] not in {v.name for v in w.vars}


@pytest.mark.parametrize(
    "name, extra",
    [("hf-gpt2", ["fp16"]), ("hf-llama", ["bf16"]), ("hf-bert", []), ("hf-gpt2", ["recompute"])],
)
def test_timeline_is_the_executors_count_at_every_op_on_the_zoos_transformers(name, extra):
    """Hugging Face models from the zoo, trained through fleet (AMP, recompute): every op's live
    bytes as the executor counts them. Their attention reshapes transposed values, which torch
    copies (a view row that makes new storage), and GPT-2 casts its labels to the dtype they have
    (no new storage): the estimate learns both from the kernels' layouts on the meta device."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "training"))
    from training_cases import batch, build_strategy, export

    main = export(name)
    fleet.init(is_collective=True)
    opt = metaopt.optimizer.Momentum(learning_rate=0.05, momentum=0.9)
    fleet.distributed_optimizer(opt, build_strategy(name, extra)).minimize(main.loss)
    feed = batch(name, 0)
    exe = metaopt.Executor("cpu", record_timeline=True)
    for _ in range(2):  # the second run: the state made, as every later step
        exe.run(main, feed=feed, fetch_list=[main.loss])
    rows = next(iter(feed.values())).shape[0]
    est = estimate_memory(main, dims={"batch": rows}, workspace=False)
    assert est.timeline == exe.memory_timeline()
    assert est.peak_bytes == exe.memory_stats()["peak_bytes"]

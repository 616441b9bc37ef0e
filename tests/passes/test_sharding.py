"""The ZeRO sharding pass (passes/sharding.py) in one process: the rewrite as text (goldens),
its plan and memory arithmetic, its refusals, and, at sharding_degree 1 (a group of one, which
this process is), training bit-identical to no sharding. The gloo workers (sharding 2 and 4, the
Hugging Face models) are in tests/training/test_sharding_workers.py."""

from __future__ import annotations

import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt import fleet
from metaopt.frontend.onnx_save import save
from metaopt.ir import Op, Split, Var, ZeroShard, parse_program, print_program, verify
from metaopt.passes.data_parallel import DataParallelError, data_parallel
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.passes.optimize import update_grads
from metaopt.passes.sharding import ShardingError, apply_sharding, plan_sharding, sharding


def _trained_program(name: str = "mlp", optimizer=None) -> metaopt.Program:
    p = exported(name)[2].clone()
    (optimizer or metaopt.optimizer.Adam(learning_rate=1e-2)).minimize(p.loss)
    return p


def _sharded(stage: int, degree: int = 2, bucket_bytes: int = 4096, scatter: bool = True) -> metaopt.Program:
    """The MLP with Adam, data parallel over `degree` workers (reduce-scattered: after the
    backward at stage 1, as made at stage 2; or all-reduced whole), sharded, as fleet does."""
    p = _trained_program()
    how = {"scatter_parts": degree, "at_update": stage == 1} if scatter else {}
    p = data_parallel(p, grads=update_grads(p), world_size=degree, bucket_bytes=0, **how)
    return sharding(p, degree=degree, stage=stage, bucket_bytes=bucket_bytes)


@pytest.mark.parametrize("stage, scatter", [(1, True), (2, True), (1, False), (3, True)])
def test_the_rewrite_reads_as_its_golden_and_parses_back(golden, stage, scatter):
    q = _sharded(stage, scatter=scatter)
    verify(q)
    text = print_program(q)
    golden(f"sharding/mlp_stage{stage}{'' if scatter else '_allreduce'}", text)
    assert print_program(parse_program(text)) == text
    plan = plan_sharding(_trained_program(), degree=2, stage=stage)  # before data parallel: whole grads
    assert "grads whole at the updates" in str(plan)


def test_beside_data_parallel_the_slices_are_all_reduced_over_the_data_axis():
    p = _trained_program()
    q = data_parallel(p, grads=update_grads(p), world_size=4, bucket_bytes=1 << 20, scatter_parts=2)
    q = sharding(q, degree=2, stage=2)
    verify(q)
    scatter, reduce = [op for op in q.ops if op.role == "comm"]
    assert scatter.type == "ReduceScatter" and reduce.type == "AllReduce"
    assert reduce.attrs["group"] == "data_parallel" and reduce.inputs == scatter.outputs
    assert all(q.vars[x].zero == q.vars[y].zero for x, y in zip(reduce.inputs, reduce.outputs, strict=True))


def test_stage_one_reduce_scatters_after_the_backward_and_stage_two_as_grads_are_made():
    def scatters_and_last_backward(q) -> tuple[list[int], int]:
        at = [i for i, op in enumerate(q.ops) if op.type == "ReduceScatter"]
        return at, max(i for i, op in enumerate(q.ops) if op.role == "backward")

    at, last = scatters_and_last_backward(_sharded(1))
    assert len(at) == 6 and min(at) > last  # whole grads through the backward
    at, last = scatters_and_last_backward(_sharded(2))
    assert len(at) == 6 and min(at) < last  # the last layer's grads reduced while the backward goes on


def test_state_vars_are_declared_as_slices_and_the_estimate_counts_1_over_n():
    plain = _trained_program()
    q = _sharded(1, degree=4)
    states = [v for v in plain.vars.values() if v.kind == "opt_state" and v.shape]
    assert states and all(q.vars[v.name].zero == ZeroShard(4, tuple(v.shape)) for v in states)
    held = sum(-(-v.nbytes({}) // 4 // 4) * 4 for v in states)  # float32: padded 1/4 of the elements
    full = sum(v.nbytes({}) for v in states)
    dims = {"batch": 4}
    assert estimate_memory(plain, dims=dims).persistable_bytes - estimate_memory(
        q, dims=dims
    ).persistable_bytes == (full - held)
    plan = plan_sharding(_trained_program(), degree=4, stage=1, bucket_bytes=4096)
    assert plan.state_bytes == full and plan.state_bytes_per_worker == held
    assert f"optimizer state {full:,} -> {held:,} bytes per worker" in str(plan)


def test_buckets_follow_segment_broadcast_bytes():
    p = _trained_program()
    one_each = plan_sharding(p, degree=2, stage=1, bucket_bytes=0)
    together = plan_sharding(p, degree=2, stage=1, bucket_bytes=1 << 30)
    assert len(one_each.buckets) == len(one_each.params) == 6 and len(together.buckets) == 1
    q = sharding(p, degree=2, stage=1, bucket_bytes=1 << 30)
    gathers = [op for op in q.ops if op.type == "ShardGather"]
    assert len(gathers) == 1 and len(gathers[0].inputs) == 6


def test_zero_shard_vars_survive_onnx_save_and_load(tmp_path):
    q = _sharded(2)
    save(q, tmp_path / "q.onnx")
    back = metaopt.load(tmp_path / "q.onnx")
    zeros = {n: v.zero for n, v in q.vars.items() if v.zero is not None and v.persistable}
    assert zeros and {n: back.vars[n].zero for n in zeros} == zeros


def test_refusals_name_what_is_at_fault():
    p = _trained_program()
    with pytest.raises(ShardingError, match=r"index \(this worker's chunk\) must be in 0..1, got 2"):
        plan_sharding(p, degree=2, stage=3, index=2)
    read_late = p.clone()  # a param read whole by the optimizer phase: stage 3 cannot gather it there
    read_late.ops.append(Op("Identity", ["fc1.weight"], ["peek"], role="optimize"))
    read_late.add_var(Var("peek", "float32", tuple(p.vars["fc1.weight"].shape), "activation"))
    with pytest.raises(NotImplementedError, match=r"reads param 'fc1.weight' whole outside the forward"):
        plan_sharding(read_late, degree=2, stage=3)
    q = sharding(p, degree=2, stage=1)
    with pytest.raises(ShardingError, match="sharded twice"):
        sharding(q, degree=2, stage=1)
    resumed = p.clone()
    state = next(v.name for v in p.vars.values() if v.kind == "opt_state" and v.shape)
    resumed.values[state] = torch.ones_like(p.values[state])
    with pytest.raises(ShardingError, match=rf"optimizer state {state!r} is not at its initial zeros"):
        plan_sharding(resumed, degree=2, stage=1)
    with pytest.raises(
        DataParallelError, match="reduce-scatter over 3 workers needs sharding groups that divide"
    ):
        data_parallel(p, grads=update_grads(p), world_size=4, bucket_bytes=0, scatter_parts=3)
    with pytest.raises(
        ValueError, match=r"var 'm': its layout zero_shard\(parts=2, full=\[5\]\) does not fit"
    ):
        Var("m", "float32", (2,), "opt_state", zero=ZeroShard(2, (5,)))
    with pytest.raises(
        ValueError, match=r"var 'm': its layout split\(axis=0, parts=2, blocks=\[6\]\) does not"
    ):
        Var("m", "float32", (4,), "opt_state", zero=ZeroShard(2, (4, 2)), split=Split(0, 2, (6,)))


def test_beside_tensor_parallel_a_split_params_state_is_the_flat_half_of_its_part():
    """Sharding a program whose fc1 is tensor parallel's [16, 32] part of [32, 32]: its state
    (stage 3: and the param) is declared ``split(...) zero_shard(...)``: the flat 1/2 of the
    local part; the full shape is the whole tensor's; the text parses back."""
    p = _trained_program()
    local = (16, 32)
    for name in ("fc1.weight", "fc1.weight@MOMENT1", "fc1.weight@MOMENT2"):
        p.vars[name] = p.vars[name].copy(shape=local, split=Split(0, 2, (32,)))
        p.vars[name].program = p
        p.values[name] = p.values[name][:16].clone()
    for n in ("fc1.weight@GRAD",):
        p.vars[n] = p.vars[n].copy(shape=local)
        p.vars[n].program = p
    q = sharding(p, degree=2, stage=1)
    m = q.vars["fc1.weight@MOMENT1"]
    assert m.zero == ZeroShard(2, local) and m.split == Split(0, 2, (32,)) and m.shape == (256,)
    assert m.full_shape == (32, 32)
    text = print_program(q)
    assert (
        "fc1.weight@MOMENT1: float32[256] opt_state split(axis=0, parts=2, blocks=[32]) zero_shard(" in text
    )
    assert print_program(parse_program(text)) == text
    three = sharding(p, degree=2, stage=3)  # the param too: the flat half of its part, gathered whole
    w = three.vars["fc1.weight"]
    assert w.zero == ZeroShard(2, local) and w.split == Split(0, 2, (32,)) and w.full_shape == (32, 32)
    assert three.vars["fc1.weight@GATHERED"].shape == local


# --- through fleet, in this process: sharding_degree 1 ------------------------------------------


def _fleet_trained(name: str, optimizer, **sharding_configs) -> dict[str, torch.Tensor]:
    fleet.init(is_collective=True)
    main = exported(name)[2].clone()
    s = fleet.DistributedStrategy()
    if sharding_configs:
        s.sharding = True
        s.sharding_configs = sharding_configs
    opt = fleet.distributed_optimizer(optimizer, s)
    opt.minimize(main.loss)
    assert ("sharding" in opt.applied_meta_list) == bool(sharding_configs)
    exe = metaopt.Executor("cpu")
    mod = programs.get(name)
    for step in range(3):
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=step), strict=True))
        exe.run(main, feed=feed, fetch_list=[main.loss])
    return {v.name: exe.scope[v.name].clone() for v in main.params()}


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_one_worker_sharded_trains_bit_identical_to_unsharded(name):
    def adam():
        return metaopt.optimizer.AdamW(learning_rate=1e-2)

    plain = _fleet_trained(name, adam())
    for stage in (1, 3):  # stage 3: params held as (the one) slice, gathered before each read
        sharded = _fleet_trained(name, adam(), sharding_degree=1, segment_broadcast_MB=0.001, stage=stage)
        assert plain.keys() == sharded.keys()
        assert all(
            torch.equal(plain[k], sharded[k].reshape(-1)[: plain[k].numel()].view_as(plain[k])) for k in plain
        )


def test_fleet_refuses_a_degree_that_is_not_the_layout_and_an_unused_sharding_axis():
    fleet.init(is_collective=True)
    s = fleet.DistributedStrategy()
    s.sharding = True  # Fleet's default sharding_degree 8, one worker
    with pytest.raises(
        ValueError, match=r"sharding_configs\['sharding_degree'\]=8 but the job has 1 workers"
    ):
        fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), s).minimize(_loss())
    s.sharding_configs = {"sharding_degree": 1, "optimize_cast": True}
    with pytest.raises(NotImplementedError, match=r"sharding_configs\['optimize_cast'\]=True"):
        fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), s).minimize(_loss())
    s.sharding_configs = {"sharding_degree": 1, "stage": 2}
    s.pipeline = True
    with pytest.raises(NotImplementedError, match=r"strategy.pipeline=True at stage 2 \(a pipeline sums"):
        fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), s).minimize(_loss())


def test_a_hybrid_sharding_axis_needs_strategy_sharding():
    from metaopt.fleet.steps import sharding_errors
    from metaopt.fleet.topology import Topology

    s = fleet.DistributedStrategy()
    (e,) = sharding_errors(s, Topology(dp_degree=1, sharding_degree=2), 2)
    assert "hybrid_configs sharding_degree=2 needs strategy.sharding=True" in str(e)
    s.sharding = True
    assert sharding_errors(s, Topology(dp_degree=1, sharding_degree=2), 2) == []  # default 8: the layout's
    s.sharding_configs = {"sharding_degree": 4}
    (e,) = sharding_errors(s, Topology(dp_degree=1, sharding_degree=2), 2)
    assert "conflicts with hybrid_configs sharding_degree=2" in str(e)
    s.pipeline = True  # sharding over every worker would mix the stages' programs
    (e,) = sharding_errors(s, Topology(dp_degree=2, pp_degree=2), 4)
    assert "sharding_degree']=4 with strategy.pipeline=True: the sharding group must be" in str(e)
    s.sharding_configs = {"sharding_degree": 2}
    assert sharding_errors(s, Topology(pp_degree=2, sharding_degree=2), 4) == []  # the hybrid axis


def _loss():
    return exported("mlp")[2].clone().loss


def test_a_one_file_checkpoint_moves_between_sharded_and_unsharded_programs(tmp_path):
    """sharding_degree 1 holds each state var flat (its own zero_shard layout): its one-file
    checkpoint holds them in their full shapes, so it loads into an unsharded program, and back."""

    def minimized(**sharding_configs):
        fleet.init(is_collective=True)
        main = exported("mlp")[2].clone()
        s = fleet.DistributedStrategy()
        if sharding_configs:
            s.sharding, s.sharding_configs = True, sharding_configs
        fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-2), s).minimize(main.loss)
        return main, metaopt.Executor("cpu")

    sharded, exe = minimized(sharding_degree=1)
    mod = programs.get("mlp")
    for step in range(2):
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=step), strict=True))
        exe.run(sharded, feed=feed, fetch_list=[sharded.loss])
    fleet.save_persistables(exe, tmp_path / "a", sharded)
    plain, exe2 = minimized()
    fleet.load_persistables(exe2, tmp_path / "a", plain)
    states = [v for v in sharded.vars.values() if v.zero is not None and v.persistable]
    assert states
    for v in states:
        assert exe2.scope[v.name].shape == v.zero.full
        assert torch.equal(exe2.scope[v.name].reshape(-1), exe.scope[v.name])
    fleet.save_persistables(exe2, tmp_path / "b", plain)
    again, exe3 = minimized(sharding_degree=1)
    fleet.load_persistables(exe3, tmp_path / "b", again)
    assert all(torch.equal(exe3.scope[v.name], exe.scope[v.name]) for v in states)


def test_clipping_runs_on_the_slices_where_the_grads_are_reduce_scattered():
    p = _trained_program(
        optimizer=metaopt.optimizer.Adam(1e-2, grad_clip=metaopt.optimizer.ClipGradByGlobalNorm(1.0))
    )
    p = data_parallel(p, grads=update_grads(p), world_size=2, bucket_bytes=0, scatter_parts=2)
    q = sharding(p, degree=2, stage=2)
    verify(q)
    (clip,) = [op for op in q.ops if op.type == "ShardedClipByGlobalNorm"]
    assert clip.attrs["group"] == "sharding" and clip.attrs["parts"] == 2
    assert all(q.vars[o].zero is not None for o in clip.outputs)
    assert not any(op.type == "ShardSlice" and set(op.inputs) & set(clip.outputs) for op in q.ops)


def test_the_memory_report_says_what_share_of_the_state_this_worker_holds():
    from metaopt.report.memory_picture import memory_picture, persistable_breakdown

    plain, q = _trained_program(), _sharded(1, degree=4)
    assert "ZeRO" not in persistable_breakdown(plain)
    text = memory_picture(q, batch=4, measure=False).summary()
    state = sum(v.nbytes({}) for v in plain.vars.values() if v.kind == "opt_state")
    from metaopt.passes.memory_estimate import human_bytes

    assert f"(ZeRO: this worker's 1/4 of {human_bytes(state)})" in text
    assert "ZeRO" not in persistable_breakdown(q).split(", optimizer")[0]  # stage 1 holds params whole
    three = persistable_breakdown(_sharded(3, degree=4))
    params = sum(v.nbytes({}) for v in plain.params())
    assert f"(ZeRO: this worker's 1/4 of {human_bytes(params)})" in three.split(", optimizer")[0]


def test_with_gradient_merge_the_sharded_updates_run_on_every_kth_run_only():
    """Gradient merge runs the update phase on the k-th run of each window; ShardSlice and
    ShardGather are in it: at sharding_degree 1, bit-identical to gradient merge alone."""

    def trained(**sharding_configs):
        fleet.init(is_collective=True)
        main = exported("mlp")[2].clone()
        s = fleet.DistributedStrategy()
        s.gradient_merge, s.gradient_merge_configs = True, {"k_steps": 2, "avg": True}
        if sharding_configs:
            s.sharding, s.sharding_configs = True, sharding_configs
        fleet.distributed_optimizer(metaopt.optimizer.Momentum(0.1), s).minimize(main.loss)
        exe = metaopt.Executor("cpu")
        mod = programs.get("mlp")
        for step in range(5):  # two windows and the first run of a third
            feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=step), strict=True))
            exe.run(main, feed=feed, fetch_list=[main.loss])
        return main, {v.name: exe.scope[v.name].clone() for v in main.params()}

    plain = trained()[1]
    main, sharded = trained(sharding_degree=1)
    assert any(op.type == "ShardGather" for op in main.ops)
    assert all(torch.equal(plain[k], sharded[k]) for k in plain)


def test_the_plan_counts_each_state_tensor_padded_by_elements_not_bytes():
    """At degree 3 the MLP's tensors do not split evenly (fc3.bias: 4 elements, 2 per worker):
    the plan's per-worker state equals what the rewritten program declares."""
    p = _trained_program()
    plan = plan_sharding(p, degree=3, stage=1)
    q = apply_sharding(p, plan)
    declared = sum(v.nbytes({}) for v in q.vars.values() if v.kind == "opt_state" and v.zero is not None)
    assert plan.state_bytes_per_worker == declared
    assert q.vars["fc3.bias@MOMENT1"].shape == (2,)


def test_beside_a_pipeline_each_stage_updates_the_slices_its_merged_grads_are_scattered_to(golden):
    """Sharding after the pipeline's split, per stage program (as fleet runs it): the split
    reduce-scatters each stage's merged grads over the sharding group (then all-reduces the slices
    over the data axis: dp_degree 2), and the sharding pass finds them sliced, so it slices only
    the params for the updates and all-gathers the new ones."""
    from conftest import backward_links

    from metaopt.passes.pipeline import pipeline

    stages = pipeline(
        _trained_program(),
        num_stages=2,
        cuts=["fc2"],
        micro_batches=2,
        dp_degree=2,
        scatter_parts=2,
        **backward_links(_trained_program()),
    )
    texts = []
    for q in stages:
        plan = plan_sharding(q, degree=2, stage=1, bucket_bytes=4096)
        assert plan.scattered and all(sp.grad_sliced for sp in plan.params) and plan.params
        q = apply_sharding(q, plan)
        verify(q)
        scatter, reduce = [op for op in q.ops if op.type in ("ReduceScatter", "AllReduce")]
        assert reduce.inputs == scatter.outputs and reduce.attrs["group"] == "data_parallel"
        assert {q.vars[x].zero.parts for x in reduce.outputs} == {2}
        assert not any(op.type == "ShardSlice" and set(op.inputs) & set(scatter.inputs) for op in q.ops)
        texts.append(print_program(q))
    text = "\n".join(texts)
    golden("sharding/mlp_pipeline_stage1", text)
    assert all(print_program(parse_program(t)) == t for t in texts)

"""passes/pipeline_phases.py: a stage program is cut into the schedule's sub-programs by a pass
(issue 33: the runtime no longer re-cuts programs). The cut is a plan, printed; each phase is a
verified program; the executor runs only a cut that matches its program."""

from __future__ import annotations

import pytest
import torch
from conftest import backward_links, exported, pipeline_split

import metaopt
from metaopt.ir import Op, roles
from metaopt.passes.pipeline import pipeline
from metaopt.passes.pipeline_phases import PhaseError, apply_phases, pipeline_phases, plan_phases


def _trained(name: str = "mlp") -> metaopt.Program:
    p = exported(name)[2].clone()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(p.loss)
    return p


def _feed(p: metaopt.Program) -> dict:
    import programs

    mod = programs.get(p.name)
    return dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=3), strict=True))


def test_the_cut_is_a_printed_plan_in_schedule_order():
    first, last = pipeline_split(_trained(), num_stages=2, cuts=["fc2"], micro_batches=2)
    plan = plan_phases(last)
    assert plan.keys == ((1, roles.FORWARD), (1, roles.BACKWARD), (-1, roles.OPTIMIZE))
    text = str(plan)
    assert "chunk 1 forward" in text and "chunk 1 backward" in text and "optimizer" in text
    # what the backward needs of the forward is carried, nothing else
    assert set(plan.carried_out[(1, roles.FORWARD)]) == set(plan.carried_in[(1, roles.BACKWARD)])
    assert plan.carried_in[(1, roles.FORWARD)] == ()
    # the updates read the grads accumulated over the micro-batches, from the scope
    opt = last.phases.get((-1, roles.OPTIMIZE)).program
    accumulated = set(last.updates)
    assert any(x in accumulated for op in opt.ops for x in op.inputs)
    assert all(p.phases is not None and p.phases.matches(p) for p in (first, last))


def test_every_op_runs_in_exactly_one_phase():
    for stage in pipeline_split(_trained("gpt"), num_stages=2, cuts=["transformer.h.1"], micro_batches=2):
        cut = [op.outputs for part in stage.phases.parts for op in part.program.ops]
        assert sorted(map(tuple, cut)) == sorted(tuple(op.outputs) for op in stage.ops)


def test_a_program_that_is_not_a_stage_is_refused_by_name():
    with pytest.raises(PhaseError, match="'mlp' is not a pipeline stage program"):
        plan_phases(_trained())


def test_a_plan_of_another_program_is_refused():
    p = _trained()
    (a,) = pipeline(p, num_stages=1, cuts=[], micro_batches=2, **backward_links(p))
    b = a.clone()
    b.name = "other"
    with pytest.raises(PhaseError, match="a phase plan of 'mlp' applied to 'other'"):
        apply_phases(b, plan_phases(a))


def test_the_executor_runs_only_a_cut_that_matches_its_program():
    p = _trained()
    (raw,) = pipeline(p, num_stages=1, cuts=[], micro_batches=2, **backward_links(p))
    with pytest.raises(ValueError, match="'mlp' has no phases: .*pipeline_phases"):
        metaopt.Executor("cpu").run(raw, feed=_feed(p), fetch_list=["loss"])
    stage = pipeline_phases(raw)
    stale = stage.clone()  # the cut travels with a clone; an edit makes it stale
    i = next(i for i, op in enumerate(stale.ops) if op.role == "backward")
    stale.ops.insert(i, Op("Identity", [stale.ops[i].inputs[0]], ["extra"], role="backward", stage=0))
    stale.add_var(stale.vars[stale.ops[i].inputs[0]].copy(name="extra", kind="activation"))
    with pytest.raises(ValueError, match="'mlp' was changed after its phases were cut"):
        metaopt.Executor("cpu").run(stale, feed=_feed(p), fetch_list=["loss"])
    (loss,) = metaopt.Executor("cpu").run(stage, feed=_feed(p), fetch_list=["loss"], return_numpy=False)
    assert torch.isfinite(loss)


def test_a_saved_stage_program_loads_cut_and_trains_as_before(tmp_path):
    """metaopt.save / metaopt.load of a stage program: the importer's last step cuts it again,
    and a step of it equals a step of the program it was saved from, bit for bit."""
    p = _trained()
    (stage,) = pipeline_split(p, num_stages=1, cuts=[], micro_batches=2)
    metaopt.save(stage, tmp_path / "stage.onnx")
    loaded = metaopt.load(tmp_path / "stage.onnx", channels_last=False)
    assert loaded.phases is not None and loaded.phases.matches(loaded)
    out = []
    for prog in (stage, loaded):
        exe = metaopt.Executor("cpu")
        (loss,) = exe.run(prog, feed=_feed(p), fetch_list=["loss"], return_numpy=False)
        out.append((loss, {v.name: exe.scope[v.name] for v in prog.params()}))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


def test_a_zero_bubble_stage_cuts_each_backward_into_b_and_w():
    """ZB-H1: B holds the receives, the sends and all they need (the grads the previous stage
    waits for); W the rest: every param grad and its accumulation, fused grad ops cut in two
    (passes/split_weight_grads.py). Together they make what 1F1B's backward makes."""
    from metaopt.ir.program import WEIGHT_PHASE

    train = _trained("gpt")
    grads = set(backward_links(train)["grads"].values())
    how = {"num_stages": 2, "cuts": ["transformer.h.1"], "micro_batches": 2}
    one = pipeline_split(train, schedule="1F1B", **how)
    zb = pipeline_split(train, schedule="ZBH1", **how)
    for a, z in zip(one, zb, strict=True):
        k = a.pipeline.stage
        assert a.phases.get((k, WEIGHT_PHASE)) is None
        b = z.phases.get((k, roles.BACKWARD)).program.ops
        w = z.phases.get((k, WEIGHT_PHASE)).program.ops
        made = {o for op in a.phases.get((k, roles.BACKWARD)).program.ops for o in op.outputs if o}
        assert {o for op in b + w for o in op.outputs if o} == made
        assert all("peer" not in op.attrs for op in w) and any("peer" in op.attrs for op in b)
        assert not grads & {o for op in b for o in op.outputs}  # no weight grad left in B
        assert grads & {o for op in w for o in op.outputs}
    split = [op for op in zb[1].ops if op.type == "LinearGrad"]
    assert {tuple(op.attrs["mask"]) for op in split} >= {(1, 0, 0), (0, 1, 1)}


def test_fleet_takes_the_zero_bubble_schedules_and_paddles_names():
    """One process (1 worker): ZB-V's V then puts both chunks on worker 0, the hand-off between
    them local; Paddle's ZBVPP is ZB-V, with chunks' default (1) meaning its two."""
    from metaopt import fleet

    fleet.init(is_collective=True)
    losses = {}
    for mode, want in (("ZBH1", "ZBH1"), ("FThenB", "F-then-B"), ("ZBV", "ZBV"), ("ZBVPP", "ZBV")):
        main = exported("mlp")[2].clone()
        s = fleet.DistributedStrategy()
        s.pipeline = True
        s.pipeline_configs = {"accumulate_steps": 2, "schedule_mode": mode, "cuts": []}
        opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), s)
        opt.minimize(main.loss)
        assert main.pipeline.schedule == want
        cut = str(opt.context.plans["pipeline_phases"])  # each stage's cut, printed
        assert ("chunk 0 weight" in cut) == (want in ("ZBH1", "ZBV")) and "chunk 0 backward" in cut
        assert ("chunk 1 weight" in cut) == (want == "ZBV")
        assert main.pipeline.chunks == (2 if want == "ZBV" else 1)
        assert not [op for op in main.ops if "peer" in op.attrs]  # one worker: no messages
        exe = metaopt.Executor("cpu")
        losses[want] = [float(exe.run(main, feed=_feed(main), fetch_list=["loss"])[0]) for _ in range(2)]
    # the same micro-batches and updates whatever the schedule (float sums in another order)
    assert losses["ZBV"] == pytest.approx(losses["ZBH1"], rel=1e-5)
    assert losses["ZBV"][1] < losses["ZBV"][0]  # it trains

"""The pipeline pass in one process: stage assignment, cuts, transfers, goldens, round trips.
(Training through real workers against single-process training: tests/training/test_pipeline.py.)"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import backward_links, exported, pipeline_split

import metaopt
from metaopt.frontend import onnx_save
from metaopt.ir import parse_program, verify
from metaopt.passes.pipeline import PipelineError, plan_pipeline
from metaopt.passes.recompute import recompute


@functools.cache
def _train(name: str) -> metaopt.Program:
    _, _, program = exported(name)
    main = program.clone()
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(main.loss)
    return main


def _sends_match_recvs(stages: list[metaopt.Program]) -> int:
    """Every Send has the Recv of the same var on its peer, in the same order per (pair, role)."""
    sent: dict[tuple, list[str]] = {}
    got: dict[tuple, list[str]] = {}
    for q in stages:
        for op in q.ops:
            if op.type == "Send":
                sent.setdefault((op.stage, op.attrs["peer"], op.role), []).append(op.inputs[0])
            elif op.type == "Recv":
                got.setdefault((op.attrs["peer"], op.stage, op.role), []).append(op.outputs[0])
    assert sent == got
    return sum(len(v) for v in sent.values())


@pytest.mark.parametrize(
    "name,cuts",
    [("mlp", ["fc2"]), ("bert", ["bert.encoder.layer.1"]), ("gpt", ["transformer.h.1"])],
)
def test_stage_programs_verify_and_every_send_has_its_recv(name, cuts):
    main = _train(name)
    stages = pipeline_split(main, num_stages=2, cuts=cuts, micro_batches=4)
    assert [q.pipeline.stage for q in stages] == [0, 1]
    for q in stages:
        verify(q)
        assert str(parse_program(str(q))) == str(q)
        assert all(op.stage == q.pipeline.stage for op in q.ops)
    assert _sends_match_recvs(stages) > 0
    # every forward/backward op of the single program runs on exactly one stage
    per_stage = [
        sum(1 for op in q.ops if op.role in ("forward", "loss") and op.type not in ("Send", "Recv"))
        for q in stages
    ]
    assert sum(per_stage) == sum(1 for op in main.ops if op.role in ("forward", "loss"))
    assert stages[-1].loss_name == main.loss_name and stages[0].loss_name is None


def test_the_loss_grad_is_scaled_by_one_over_m_and_grads_merge():
    stages = pipeline_split(_train("mlp"), num_stages=2, cuts=["fc2"], micro_batches=4)
    last = stages[-1]
    seed = next(op for op in last.ops if op.outputs == ["loss@GRAD"])
    assert last.values[seed.inputs[0]].item() == pytest.approx(0.25)
    merges = [op for q in stages for op in q.ops if op.type == "GradMerge"]
    assert len(merges) == len(_train("mlp").params())
    for q in stages:
        for op in q.ops:
            if op.type == "AdamUpdate":
                assert op.inputs[1].endswith("@MERGED@NEW")  # the update reads the accumulated grad


def test_tied_embedding_is_held_by_both_ends_and_all_reduced():
    main = _train("gpt")
    plan = plan_pipeline(main, grads=backward_links(main)["grads"], num_stages=2, cuts=["transformer.h.1"])
    assert plan.shared == {"transformer.wte.weight": (0, 1)}
    stages = pipeline_split(main, num_stages=2, cuts=["transformer.h.1"])
    for q in stages:
        assert "transformer.wte.weight" in q.vars
        reduce = [op for op in q.ops if op.type == "AllReduce"]
        assert len(reduce) == 1 and reduce[0].attrs == {"reduce": "sum", "ranks": [0, 1]}
        assert q.pipeline.groups == ((0, 1),)


def test_recompute_across_a_cut_reads_the_received_original():
    main = _train("gpt")
    rc = recompute(main, checkpoints=["transformer.h.*"])
    stages = pipeline_split(rc, num_stages=4, cuts=["transformer.h.0", "transformer.h.1", "transformer.ln_f"])
    for q in stages:
        verify(q)
        produced = {o for op in q.ops for o in op.outputs}
        for op in q.ops:  # nothing reads a recomputed copy this stage did not make
            assert all(x in produced or "@RECOMPUTE" not in x for x in op.inputs), op


def test_auto_cuts_balance_the_forward_cost_at_module_starts():
    main = _train("bert")
    plan = plan_pipeline(main, grads=backward_links(main)["grads"], num_stages=2)
    ((cut, at),) = plan.cuts
    assert main.ops[at].scope == cut or main.ops[at].scope.startswith(cut + ".")  # a module's first op
    share = max(plan.costs) / sum(plan.costs)
    assert share < 0.75, plan  # two stages, neither more than 3/4 of the work
    text = str(plan)
    assert "stage 0 (worker 0)" in text and "stage 1 (worker 1)" in text


def test_cut_errors_name_the_cut():
    main = _train("mlp")
    with pytest.raises(PipelineError, match=r"names 2 cut\(s\) but 2 \(virtual\) stages need 1"):
        plan_pipeline(main, grads=backward_links(main)["grads"], num_stages=2, cuts=["fc2", "fc3"])
    with pytest.raises(
        PipelineError, match=r"'fc22' is neither a module path nor a forward var.*did you mean"
    ):
        plan_pipeline(main, grads=backward_links(main)["grads"], num_stages=2, cuts=["fc22"])
    with pytest.raises(PipelineError, match=r"'fc2' begins at op .*not after 'fc3'"):
        plan_pipeline(main, grads=backward_links(main)["grads"], num_stages=3, cuts=["fc3", "fc2"])
    with pytest.raises(PipelineError, match="leaves stage 0 empty"):
        plan_pipeline(main, grads=backward_links(main)["grads"], num_stages=2, cuts=["fc1"])


def test_stage_program_saves_and_loads_as_onnx(tmp_path):
    stages = pipeline_split(_train("mlp"), num_stages=2, cuts=["fc2"], micro_batches=2, schedule="F-then-B")
    for q in stages:
        onnx_save.save(q, tmp_path / f"stage{q.pipeline.stage}.onnx")
        again = metaopt.load(tmp_path / f"stage{q.pipeline.stage}.onnx")
        assert again.pipeline == q.pipeline
        assert str(again) == str(q)


@pytest.mark.parametrize("name,cuts", [("mlp", ["fc2"]), ("gpt", ["transformer.h.1"])])
def test_pipeline_golden(name, cuts, golden):
    stages = pipeline_split(_train(name), num_stages=2, cuts=cuts, micro_batches=4)
    golden(f"pipeline/{name}", "".join(str(q) for q in stages))


def test_single_stage_pipeline_is_the_program_with_merged_grads():
    main = _train("mlp")
    (only,) = pipeline_split(main, num_stages=1, cuts=[], micro_batches=1)
    assert not any(op.type in ("Send", "Recv") for op in only.ops)
    verify(only)
    assert torch.equal(only.values["fc1.weight"], main.values["fc1.weight"])


def test_fetching_a_name_no_stage_holds_is_an_error_not_none():
    (stage,) = pipeline_split(_train("mlp"), num_stages=1, cuts=[], micro_batches=2)
    assert stage.pipeline.loss == "loss"
    _, inputs, _ = exported("mlp")
    feed = dict(zip(["x", "label"], [torch.cat([t, t]) for t in inputs], strict=True))
    exe = metaopt.Executor("cpu")
    (loss,) = exe.run(stage, feed=feed, fetch_list=["loss"])
    assert loss is not None and float(loss) > 0
    with pytest.raises(KeyError, match=r"fetch 'los'.*did you mean"):
        exe.run(stage, feed=feed, fetch_list=["los"])

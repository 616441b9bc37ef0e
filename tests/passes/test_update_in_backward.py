"""optimizer_in_backward (passes/update_in_backward.py): updates moved into the backward are
the same step bit for bit; the tied embedding's in-place accumulation is exact by the float64
metric; the peak drops by most of the gradient bytes, predicted and measured alike."""

from __future__ import annotations

import functools

import export_cache
import pytest
import torch
from conftest import exported
from zoo.harness import judge_grads, torch_grads

import metaopt
import programs
from metaopt.ir import Op, Var, parse_program, verify
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.passes.update_in_backward import plan_update_in_backward, update_in_backward


def _train(name: str, optimizer, dropout: float = 0.1) -> metaopt.Program:
    _, _, program = exported(name, dropout=dropout)
    main = program.clone()
    optimizer.minimize(main.loss)
    return main


def _run(p: metaopt.Program, name: str, steps: int = 3, fetch_grads: bool = False):
    mod = programs.get(name)
    metaopt.seed(7)
    exe = metaopt.Executor("cpu", track_memory=True)
    grads = [f"{v.name}@GRAD" for v in p.params()] if fetch_grads else []
    losses = []
    for s in range(steps):
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=s), strict=True))
        out = exe.run(p, feed=feed, fetch_list=[p.loss, *grads], return_numpy=False)
        losses.append(out[0])
    return losses, dict(exe.scope), exe.memory_stats()["peak_bytes"]


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_moving_the_updates_is_the_same_step_bitwise(name, opt):
    optimizer = (
        metaopt.optimizer.SGD(learning_rate=0.1)
        if opt == "sgd"
        else metaopt.optimizer.Adam(learning_rate=1e-2)
    )
    base = _train(name, optimizer)
    plan = plan_update_in_backward(base)
    plan.accumulations = []  # the moves alone: exactly the same ops, reordered
    moved = update_in_backward(base, plan=plan)
    verify(moved)
    assert len(plan.moves) >= len(base.params())  # every param's update moved (+ lr-sched ops)
    assert any(op.role == "backward-update" for op in moved.ops)
    first_update = next(i for i, op in enumerate(moved.ops) if op.role == "backward-update")
    assert any(op.role == "backward" for op in moved.ops[first_update:])  # inside the backward
    (la, sa, _), (lb, sb, _) = _run(base, name), _run(moved, name)
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@functools.cache
def _tied(name: str):
    """bert's MLM decoder and gpt's LM head share the word embedding. gpt at vocab 2048: its
    head + loss are fused (LinearCrossEntropy, >= 1024 classes), whose weight grad is new
    storage to add into; at the tiny vocab the head's grad arrives as a transposed view."""
    mod = programs.get(name)
    over = {"dropout": 0.0, **({"vocab_size": 2048} if name == "gpt" else {})}
    module = mod.build("tiny", seed=0, **over)
    inputs = mod.example_inputs("tiny", 4, seed=1, **over)
    program = export_cache.export(module, inputs, name=name)
    return module, inputs, program


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_the_tied_embedding_accumulates_in_place_exactly(name):
    """The lookup's grad is added into the head's contribution in place. The float64 metric
    (DESIGN.md) on every grad, and one SGD step against the unfused program."""
    module, inputs, program = _tied(name)
    from metaopt import fleet

    base = program.clone()
    fleet.init()  # fleet's default steps fuse the head and loss (fuse_linear_ce)
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), fleet.DistributedStrategy())
    opt.minimize(base.loss)
    plan = plan_update_in_backward(base)
    assert len(plan.accumulations) == 1, str(plan)
    early = update_in_backward(base, plan=plan)
    verify(early)
    lookups = [sum(op.type == "EmbeddingGrad" for op in p.ops) for p in (base, early)]
    assert lookups[1] == lookups[0] - 1
    assert sum(op.type == "EmbeddingGradAccumulate" for op in early.ops) == 1
    mod = programs.get(name)
    feed = dict(zip(mod.INPUT_NAMES, inputs, strict=True))
    names = [v.name for v in base.params()]
    got = metaopt.Executor("cpu").run(
        early, feed=feed, fetch_list=[f"{n}@GRAD" for n in names], return_numpy=False
    )
    ours = dict(zip(names, got, strict=True))
    verdicts = judge_grads(
        ours, torch_grads(module, inputs, double=False), torch_grads(module, inputs, double=True)
    )
    assert not [v for v in verdicts if v.wrong], [v for v in verdicts if v.wrong]
    # One SGD step equals the unfused one (rtol 1e-5: only the tied grad's rounding differs).
    after = []
    for p in (base, early):
        exe = metaopt.Executor("cpu")
        exe.run(p, feed=feed, fetch_list=[p.loss])
        after.append({n: exe.scope[n].clone() for n in names})
    for n in names:
        torch.testing.assert_close(after[1][n], after[0][n], rtol=1e-5, atol=1e-7)


def test_a_lookup_grad_that_is_the_accumulator_is_left_alone():
    """gpt with its tied LM head written as MatMul on the table's transposed view (as the exporter
    gives it before the import fuses it into Linear): the head's grad is a transposed view, so
    the lookup's own grad is the accumulator; nothing to add into, said in the plan. (Fused, the
    head's LinearGrad makes fresh storage, which the lookup's grad is added into.)"""
    _, _, program = exported("gpt", dropout=0.0)
    unfused = program.clone()
    (i,) = [
        i
        for i, op in enumerate(unfused.ops)
        if op.inputs[1:2] == ["transformer.wte.weight"] and op.outputs == ["lm_head"]
    ]
    head = unfused.ops[i]
    w = "transformer.wte.weight"
    unfused.add_var(Var("lm_head/wt", "float32", tuple(reversed(unfused.vars[w].shape))))
    unfused.ops[i : i + 1] = [
        Op("Transpose", [w], ["lm_head/wt"], {"perm": [1, 0]}, role=head.role, scope=head.scope),
        Op("MatMul", [head.inputs[0], "lm_head/wt"], ["lm_head"], role=head.role, scope=head.scope),
    ]
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(unfused.loss)
    plan = plan_update_in_backward(unfused)
    assert not plan.accumulations
    assert "EmbeddingGrad of 'transformer.wte.weight': its own grad is the accumulator" in str(plan)
    fused = plan_update_in_backward(_train("gpt", metaopt.optimizer.SGD(learning_rate=0.1), dropout=0.0))
    assert [a.op.type for a in fused.accumulations] == ["EmbeddingGradAccumulate"]


@functools.cache
def _bert_small_recompute() -> metaopt.Program:
    """A BERT whose grads are a large part of the step (vocab 2000, width 64, 4 layers), with a
    checkpoint per layer: its peak is at the end of the backward, where every grad is alive."""
    from metaopt import fleet

    mod = programs.get("bert")
    cfg = {"vocab_size": 2000, "hidden_size": 64, "intermediate_size": 128, "num_layers": 4, "dropout": 0.0}
    model = mod.build("tiny", seed=0, **cfg)
    main = export_cache.export(model, mod.example_inputs("tiny", 2, seed=1, **cfg), name="bert")
    fleet.init()
    s = fleet.DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["bert.encoder.layer.*"]}
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), s).minimize(main.loss)
    return main


def test_the_peak_drops_by_most_of_the_gradient_bytes_predicted_and_measured():
    base = _bert_small_recompute()
    early = update_in_backward(base, plan=plan_update_in_backward(base))
    grad_bytes = sum(v.nbytes({}) for v in base.params())
    dims = {"batch": 2}
    predicted = [estimate_memory(p, dims=dims, workspace=False).peak_bytes for p in (base, early)]
    mod = programs.get("bert")
    cfg = {"vocab_size": 2000, "hidden_size": 64, "intermediate_size": 128, "num_layers": 4}
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 2, seed=3, **cfg), strict=True))
    measured = []
    for p in (base, early):
        exe = metaopt.Executor("cpu", track_memory=True)
        exe.run(p, feed=feed, fetch_list=[p.loss])
        measured.append(exe.memory_stats()["peak_bytes"])
    assert predicted == measured  # the executor's accounting is what the estimate replays
    drop = predicted[0] - predicted[1]
    assert drop >= 0.8 * grad_bytes, (drop / grad_bytes, predicted, grad_bytes)


def test_nothing_to_move_without_an_optimizer():
    _, _, program = exported("mlp", dropout=0.0)
    plan = plan_update_in_backward(program)
    assert not plan.moves and plan.skipped == ["the program has no optimizer ops"]
    assert update_in_backward(program, plan=plan).ops == program.ops


def test_golden(golden):
    base = _train("mlp", metaopt.optimizer.Adam(learning_rate=1e-2), dropout=0.0)
    plan = plan_update_in_backward(base)
    early = update_in_backward(base, plan=plan)
    text = str(early)
    assert str(parse_program(text)) == text
    golden("update_in_backward/mlp_adam", text)
    golden("update_in_backward/mlp_adam_plan", str(plan) + "\n")


# --- through fleet: strategy.optimizer_in_backward -------------------------------------------


def _fleet_mlp(optimizer, **strategy):
    from metaopt import fleet

    _, _, program = exported("mlp", dropout=0.3)
    main = program.clone()
    fleet.init()
    s = fleet.DistributedStrategy()
    for k, v in strategy.items():
        setattr(s, k, v)
    opt = fleet.distributed_optimizer(optimizer, s)
    opt.minimize(main.loss)
    return main, opt


@pytest.mark.parametrize(
    "strategy",
    [
        {"recompute": True, "recompute_configs": {"checkpoints": ["fc1", "fc2"], "enable_offload": True}},
        {"amp": True, "amp_configs": {"dtype": "bfloat16", "use_pure_fp16": True, "use_fp16_guard": False}},
    ],
    ids=["recompute-offload", "bf16-master-weights"],
)
def test_fleet_composes_and_stays_bitwise(strategy):
    """With recompute + offload (dropout on) and with bf16 master weights, the updates move after
    every recomputed read and every master-weight cast: the same step bit for bit."""
    base, _ = _fleet_mlp(metaopt.optimizer.Adam(learning_rate=1e-2), **strategy)
    early, opt = _fleet_mlp(
        metaopt.optimizer.Adam(learning_rate=1e-2), optimizer_in_backward=True, **strategy
    )
    assert "early_updates    run" in str(opt.plan())
    assert opt.context.plans["early_updates"].moves
    assert any(op.role == "backward-update" for op in early.ops)
    (la, sa, _), (lb, sb, _) = _run(base, "mlp", steps=4), _run(early, "mlp", steps=4)
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "optimizer, strategy, refused",
    [
        (
            metaopt.optimizer.SGD(learning_rate=0.1, grad_clip=metaopt.optimizer.ClipGradByGlobalNorm(1.0)),
            {},
            "grad_clip=ClipGradByGlobalNorm reads every grad",
        ),
        (None, {"gradient_merge": True}, "gradient_merge=True updates every k-th run"),
        (None, {"amp": True}, "AMP loss scaling checks every grad"),
        (None, {"pipeline": True}, "pipeline=True updates once per step"),
    ],
    ids=["global-norm-clip", "gradient-merge", "fp16-loss-scaling", "pipeline"],
)
def test_what_needs_every_grad_first_is_refused_by_name(optimizer, strategy, refused):
    optimizer = optimizer or metaopt.optimizer.SGD(learning_rate=0.1)
    with pytest.raises(ValueError, match=r"optimizer_in_backward=True cannot be combined: .*" + refused):
        _fleet_mlp(optimizer, optimizer_in_backward=True, **strategy)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_1_and_2_refuse_it_naming_the_stage(stage):
    """Stage 3 takes the moved updates (each grad slice freed at its update: the sharding workers'
    test, tests/training/test_sharding_workers.py); stages 1 and 2 all-gather the updated slices
    after the backward, where the moves raised the measured peak: refused, not run worse."""
    with pytest.raises(NotImplementedError, match=rf"optimizer_in_backward=True at stage {stage} \("):
        _fleet_mlp(
            metaopt.optimizer.SGD(learning_rate=0.1),
            optimizer_in_backward=True,
            sharding=True,
            sharding_configs={"stage": stage, "sharding_degree": 1},
        )

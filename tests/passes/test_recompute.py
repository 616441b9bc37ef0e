"""Recompute: checkpoint resolution, bit-identity with no recompute (dropout on), memory, goldens."""

from __future__ import annotations

import functools

import export_cache
import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import parse_program, verify
from metaopt.passes.recompute import (
    RecomputeError,
    apply_recompute,
    memory_report,
    plan_recompute,
    recompute,
    resolve_checkpoints,
)

# Checkpoint sets per tiny program (2 blocks each): each block, the first, the last.
SETS = {
    "mlp": [["fc1", "fc2"], ["fc1"], ["fc2"]],
    "bert": [["bert.encoder.layer.*"], ["bert.encoder.layer.0"], ["bert.encoder.layer.1"]],
    "gpt": [["transformer.h.*"], ["transformer.h.0"], ["transformer.h.1"]],
}
STEPS = 10


@functools.cache
def _train_program(name: str, dropout: float = 0.5) -> metaopt.Program:
    _, _, program = exported(name, dropout=dropout)
    main = program.clone()
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(main.loss)
    return main


def _run(program: metaopt.Program, name: str, seed: int, steps: int = STEPS):
    mod = programs.get(name)
    exe = metaopt.Executor("cpu")
    metaopt.seed(seed)
    losses, grads = [], []
    grad_names = [f"{v.name}@GRAD" for v in program.params()]
    for s in range(steps):
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=1000 * seed + s), strict=True))
        out = exe.run(program, feed=feed, fetch_list=[program.loss, *grad_names], return_numpy=False)
        losses.append(out[0])
        grads.append(out[1:])
    return losses, grads, dict(exe.scope), exe.memory_stats()


def _identical(a, b) -> bool:
    (la, ga, sa, _), (lb, gb, sb, _) = a, b
    return (
        all(torch.equal(x, y) for x, y in zip(la, lb))
        and all(torch.equal(x, y) for gs, hs in zip(ga, gb) for x, y in zip(gs, hs))
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
    )


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt"])
def test_recompute_is_bit_identical_to_no_recompute(name):
    """3 seeds x 10 SGD steps, dropout 0.5 in every block: loss, every grad, params (each seed
    draws other masks; 3, not 10, to keep the suite within its time on 2 cores)."""
    base = _train_program(name)
    rewritten = [recompute(base, checkpoints=ck) for ck in SETS[name]]
    for program in rewritten:
        verify(program)
    # (mlp with only fc1: nothing precedes it and the tail is never recomputed)
    assert sum(any(op.role == "recompute" for op in p.ops) for p in rewritten) >= 2
    for seed in range(3):
        ref = _run(base, name, seed)
        for ck, program in zip(SETS[name], rewritten):
            assert _identical(ref, _run(program, name, seed)), (name, ck, seed)


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt"])
def test_without_rng_replay_recompute_differs(name):
    """Negative control: recomputed dropout masks drawn afresh change the grads."""
    base = _train_program(name)
    plain = recompute(base, checkpoints=SETS[name][0], seed_random_ops=False)
    assert not any(op.type == "RngReplay" for op in plain.ops)
    assert not _identical(_run(base, name, 0, steps=2), _run(plain, name, 0, steps=2))


def test_checkpoint_resolution():
    p = _train_program("bert")
    assert resolve_checkpoints(p, ["bert.encoder.layer.*"]) == ["bert.encoder.layer.0", "bert.encoder"]
    # exact names, order and duplicates do not matter
    a = plan_recompute(p, checkpoints=["bert.encoder", "bert.encoder.layer.0", "bert.encoder"])
    b = plan_recompute(p, checkpoints=["bert.encoder.layer.0", "bert.encoder"])
    assert a.checkpoints == b.checkpoints == ["bert.encoder.layer.0", "bert.encoder"]
    with pytest.raises(RecomputeError, match=r"checkpoint 'bert.encoder.layr.0'.*did you mean"):
        resolve_checkpoints(p, ["bert.encoder.layr.0"])
    plan = plan_recompute(p, checkpoints=["bert.encoder.layer.0", "bert.embeddings.word_embeddings.weight"])
    assert (
        "bert.embeddings.word_embeddings.weight",
        "not computed by the forward (a param, input or constant)",
    ) in plan.skipped


def test_no_recomputed_activation_lives_across_the_gap():
    """Between the forward's end and a segment's backward, only checkpoints (and held
    values) of recomputed segments are read: nothing else of them stays alive."""
    base = _train_program("bert")
    q = recompute(base, checkpoints=["bert.encoder.layer.*"])
    plan = plan_recompute(base, checkpoints=["bert.encoder.layer.*"])
    fwd_end = next(i for i, op in enumerate(q.ops) if op.role not in ("forward", "loss"))
    recomputed = {o for s in plan.segments for i in s.ops for o in base.ops[i].outputs if o}
    kept = set(plan.checkpoints) | set(plan.held)
    late_reads = {x for op in q.ops[fwd_end:] for x in op.inputs if x}
    assert not (recomputed - kept) & late_reads


@functools.cache
def _bert24() -> metaopt.Program:
    bert = programs.get("bert")
    module = bert.build("tiny", seed=0, dropout=0.1, num_layers=24)
    program = export_cache.export(module, bert.example_inputs("tiny", 4, num_layers=24), name="bert24")
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(program.loss)
    return program


def _measured_activation_peak(program: metaopt.Program, batch: int) -> int:
    bert = programs.get("bert")
    feed = dict(zip(bert.INPUT_NAMES, bert.example_inputs("tiny", batch, num_layers=24, seed=3), strict=True))
    exe = metaopt.Executor("cpu")
    metaopt.seed(0)
    exe.run(program, feed=feed, fetch_list=[program.loss])
    stats = exe.memory_stats()
    return stats["peak_bytes"] - stats["persistable_bytes"]


def test_fleet_recompute_path_and_plan():
    fleet.init(is_collective=True)
    _, _, program = exported("bert", dropout=0.5)
    main = program.clone()
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["bert.encoder.layer.*"]}
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), strategy)
    ops, params_grads = opt.minimize(main.loss)
    assert opt.applied_meta_list == ["recompute"]
    assert ops and all(op.role == "optimize" for op in ops) and len(params_grads) == len(main.params())
    assert _identical(_run(_train_program("bert"), "bert", 1, steps=3), _run(main, "bert", 1, steps=3))
    assert opt.recompute_plan.checkpoints == ["bert.encoder.layer.0", "bert.encoder"]
    report = opt.memory_report
    assert report.saves_memory and set(report.checkpoint_bytes) == set(opt.recompute_plan.checkpoints)
    assert "predicted activation peak" in str(report)


def test_predicted_peak_within_ten_percent_of_measured_and_recompute_holds_at_most_a_quarter():
    """BERT at 24 layers, batch 16: the activation peak with a checkpoint per layer is at most a
    quarter of the peak without, and each is predicted within 10% of the measured."""
    bert = programs.get("bert")
    program = _bert24()
    plan = plan_recompute(program, checkpoints=["bert.encoder.layer.*"])
    q = recompute(program, checkpoints=["bert.encoder.layer.*"])
    report = memory_report(program, plan, q, batch=16)
    feed = dict(zip(bert.INPUT_NAMES, bert.example_inputs("tiny", 16, num_layers=24, seed=3), strict=True))
    peaks = []
    for prog, predicted in ((program, report.peak_before), (q, report.peak_after)):
        exe = metaopt.Executor("cpu")
        metaopt.seed(0)
        exe.run(prog, feed=feed, fetch_list=[prog.loss])
        stats = exe.memory_stats()
        measured = stats["peak_bytes"] - stats["persistable_bytes"]
        assert abs(predicted - measured) <= 0.10 * measured, (prog.name, predicted, measured)
        peaks.append(measured)
    assert peaks[1] <= 0.25 * peaks[0], peaks


def test_a_plan_that_saves_nothing_is_warned_about():
    fleet.init(is_collective=True)
    _, _, program = exported("mlp", dropout=0.1)
    main = program.clone()
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["fc1"]}  # nothing precedes fc1: no segment to recompute
    with pytest.warns(UserWarning, match="does not lower the predicted activation peak"):
        fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), strategy).minimize(main.loss)


FLEET_RESNET_NAMES = [
    f"res{stage}{chr(ord('a') + k)}" for stage, n in zip(range(2, 6), (3, 4, 6, 3)) for k in range(n)
]


@pytest.mark.parametrize(
    "name,checkpoints",
    [
        ("mlp", ["fc1", "fc2"]),
        ("bert", ["bert.encoder.layer.*"]),
        # Fleet's train_fleet_recompute example: ResNet-50's blocks res2a ... res5c
        # (tiny width, ResNet-50 depths)
        ("resnet", FLEET_RESNET_NAMES),
    ],
)
def test_recompute_golden(name, checkpoints, golden):
    if name == "resnet":
        resnet = programs.get("resnet")
        module = resnet.build("tiny", seed=0, depths=(3, 4, 6, 3))
        inputs = resnet.example_inputs("tiny", 4, depths=(3, 4, 6, 3))
        base = export_cache.export(module, inputs, name="resnet")
        metaopt.optimizer.SGD(learning_rate=0.1).minimize(base.loss)
    else:
        base = _train_program(name, dropout=0.1)
    q = recompute(base, checkpoints=checkpoints)
    verify(q)
    text = str(q)
    golden(f"recompute/{name}", text)
    assert str(parse_program(text)) == text


def test_selective_policy_keeps_matmul_outputs_and_stays_bit_identical():
    """Selective keeps the outputs of `expensive` (matmul-class) ops that multiply by a weight
    (bert: Linear, Gemm) and recomputes the rest, the fused attention included: it is
    `expensive` too but reads no param, so it is re-run with its dropout mask replayed."""
    sdpa = "ScaledDotProductAttention"
    base = _train_program("bert")
    assert any(op.type == sdpa for op in base.ops)  # the importer fused bert's attention
    full = plan_recompute(base, checkpoints=["bert.encoder.layer.*"])
    sel = plan_recompute(base, checkpoints=["bert.encoder.layer.*"], policy="selective")
    kept_ops = [op for op in base.ops if set(op.outputs) & set(sel.kept_by_policy)]
    assert kept_ops and {op.type for op in kept_ops} <= {"MatMul", "Gemm", "Linear", "Conv"}
    params = {v.name for v in base.params()}
    assert all(set(op.inputs) & params for op in kept_ops)  # weight products only
    assert sum(map(len, (s.ops for s in sel.segments))) < sum(map(len, (s.ops for s in full.segments)))
    q = recompute(base, checkpoints=["bert.encoder.layer.*"], policy="selective")
    recomputed = [op for op in q.ops if op.role == "recompute"]
    assert recomputed and not any({"Gemm", "Linear"} & {op.type} for op in recomputed)
    # the attention core is recomputed, inside an RngReplay (dropout 0.5: the same mask again)
    assert any(op.type == "RngReplay" and op.attrs["op"] == sdpa for op in recomputed)
    assert _identical(_run(base, "bert", 2, steps=3), _run(q, "bert", 2, steps=3))
    # a user's own list of op types to keep
    user = plan_recompute(base, checkpoints=["bert.encoder.layer.*"], keep_op_types=(sdpa,))
    assert {op.type for op in base.ops for o in op.outputs if o in set(user.kept_by_policy)} == {sdpa}
    uq = recompute(base, checkpoints=["bert.encoder.layer.*"], keep_op_types=(sdpa,))
    assert not any(sdpa in (op.type, op.attrs.get("op")) for op in uq.ops if op.role == "recompute")
    with pytest.raises(RecomputeError, match=r"unknown op type 'Softmx'.*did you mean 'Softmax'"):
        plan_recompute(base, checkpoints=["bert.encoder.layer.*"], keep_op_types=("Softmx",))
    with pytest.raises(
        RecomputeError, match=r"unknown recompute policy 'selectiv'.*did you mean 'selective'"
    ):
        plan_recompute(base, checkpoints=["bert.encoder.layer.*"], policy="selectiv")


def test_selective_golden(golden):
    q = recompute(
        _train_program("bert", dropout=0.1), checkpoints=["bert.encoder.layer.*"], policy="selective"
    )
    verify(q)
    golden("recompute/bert_selective", str(q))


def test_estimate_counts_in_place_updates_and_views_as_shared_storage():
    from metaopt.passes.memory_estimate import estimate_memory

    program = _train_program("mlp", dropout=0.1)
    mod = programs.get("mlp")
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 32, seed=1), strict=True))
    exe = metaopt.Executor("cpu")
    exe.run(program, feed=feed, fetch_list=[program.loss])
    est = estimate_memory(program, dims={"batch": 32})
    # Exact here: every op's storage behaviour is declared by its row (views, in place).
    assert est.peak_bytes == exe.memory_stats()["peak_bytes"]
    assert est.persistable_bytes == exe.memory_stats()["persistable_bytes"]


def test_auto_checkpoints_sqrt_default_and_memory_budget():
    from metaopt.passes.recompute import auto_checkpoints, block_outputs

    program = _bert24()
    blocks = block_outputs(program)
    assert len(blocks) == 24 and blocks[0] == "bert.encoder.layer.0"
    # sqrt(24) ~ 5: every fifth block
    assert auto_checkpoints(program) == [blocks[i] for i in (4, 9, 14, 19)]
    none = _measured_activation_peak(program, 16)
    every = _measured_activation_peak(recompute(program, checkpoints=blocks), 16)
    budget = (none + every) // 2
    chosen = auto_checkpoints(program, memory_budget=budget, batch=16)
    assert 0 < len(chosen) < 24
    assert (
        _measured_activation_peak(
            recompute(program, checkpoints=["auto"], memory_budget=budget, batch=16), 16
        )
        <= budget
    )
    with pytest.raises(RecomputeError, match="no choice of block checkpoints fits memory_budget=1 bytes"):
        auto_checkpoints(program, memory_budget=1, batch=16)
    with pytest.raises(RecomputeError, match="has no repeated blocks"):
        auto_checkpoints(_train_program("mlp"))


def test_recompute_never_reruns_ops_that_must_run_once():
    """RngState (and any row with recomputable=False) is held from the forward."""
    q = recompute(_train_program("bert"), checkpoints=["bert.encoder.layer.*"])
    q2 = recompute(q, checkpoints=["bert.encoder.layer.0.attention.output.dense"])
    assert not any(op.type == "RngState" and op.role == "recompute" for op in q2.ops)
    assert _identical(_run(_train_program("bert"), "bert", 5, steps=2), _run(q2, "bert", 5, steps=2))


def test_fetching_a_contribution_that_is_accumulated_into_returns_its_own_value():
    base = _train_program("bert", dropout=0.0)
    acc = next(op for op in base.ops if op.type == "GradAccumulate")
    mod = programs.get("bert")
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 2, seed=1), strict=True))
    part, total = metaopt.Executor().run(
        base, feed=feed, fetch_list=[acc.inputs[0], acc.outputs[0]], return_numpy=False
    )
    rest = metaopt.Executor().run(base, feed=feed, fetch_list=acc.inputs[1:], return_numpy=False)
    torch.testing.assert_close(part + sum(rest), total, rtol=1e-6, atol=1e-7)
    assert not torch.equal(part, total)


@pytest.mark.slow  # 16 s; the budget itself is held in the suite by ..._sqrt_default_and_memory_budget
def test_auto_budget_respects_the_selective_policy():
    from metaopt.passes.memory_estimate import estimate_memory
    from metaopt.passes.recompute import auto_checkpoints

    program = _bert24()
    budget = estimate_memory(recompute(program, checkpoints=["auto"], policy="selective"), dims={"batch": 16})
    chosen = auto_checkpoints(
        program, memory_budget=budget.activation_peak_bytes, batch=16, policy="selective"
    )
    q = recompute(program, checkpoints=chosen, policy="selective")
    assert estimate_memory(q, dims={"batch": 16}).activation_peak_bytes <= budget.activation_peak_bytes


def test_a_recompute_program_saves_and_loads_back(tmp_path):
    """A recomputed LayerNormalization is re-emitted for its mean and rstd only: its output 0 is
    unnamed in the program, which the ONNX checker refuses in a file. Saving names it, loading
    unnames it again: the same ops, the same step."""
    from metaopt.frontend import onnx_save

    main = _train_program("bert", dropout=0.0)
    plan = plan_recompute(main, checkpoints=SETS["bert"][0])
    program = apply_recompute(main, plan)
    assert any(op.outputs[0] == "" for op in program.ops if op.role == "recompute")
    path = tmp_path / "bert_recompute.onnx"
    onnx_save.save(program, path)
    loaded = metaopt.load(path)
    assert [str(op) for op in loaded.ops] == [str(op) for op in program.ops]
    (la, _, sa, _), (lb, _, sb, _) = _run(program, "bert", 0, steps=2), _run(loaded, "bert", 0, steps=2)
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_head_held_when_recompute_head_is_false():
    """recompute_head=False (torch.utils.checkpoint's placement): the ops before the first
    checkpoint run once and their values are held; every later segment is re-run as before;
    still bit-identical to no recompute, dropout included."""
    base = _train_program("gpt")
    ck = ["transformer.drop", "transformer.h.*"]
    fleet_plan = plan_recompute(base, checkpoints=ck)
    held_plan = plan_recompute(base, checkpoints=ck, recompute_head=False)
    assert fleet_plan.segments[0].start is None and fleet_plan.segments[0].ops  # Fleet re-runs the head
    assert [s.start for s in held_plan.segments] == fleet_plan.checkpoints[:-1]
    assert [s.ops for s in held_plan.segments] == [s.ops for s in fleet_plan.segments[1:]]
    assert "<head> -> " in str(held_plan) and "held, not recomputed (recompute_head=False)" in str(held_plan)
    q = recompute(base, checkpoints=ck, recompute_head=False)
    verify(q)
    head_ops = set(fleet_plan.segments[0].ops)
    head_values = {o for i in head_ops for o in base.ops[i].outputs}
    recomputed_origins = {op.origin for op in q.ops if op.role == "recompute"}
    assert recomputed_origins and not (recomputed_origins & head_values)
    assert _identical(_run(base, "gpt", 3, steps=3), _run(q, "gpt", 3, steps=3))
    # through fleet: the key is checked and passed on
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ck, "recompute_head": False}
    main = exported("gpt", dropout=0.5)[2].clone()
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(learning_rate=0.1), strategy)
    opt.minimize(main.loss)
    plan = opt.recompute_plan
    assert plan.head_held and len(plan.segments) == len(plan.checkpoints) - 1
    assert _identical(_run(_train_program("gpt"), "gpt", 1, steps=2), _run(main, "gpt", 1, steps=2))
    with pytest.raises(
        ValueError, match=r"unknown key 'recompute_heads' \(did you mean 'recompute_head'\?\)"
    ):
        strategy.recompute_configs = {"checkpoints": ck, "recompute_heads": False}


def test_batch_norm_statistics_are_held_not_recomputed():
    """A block's last BatchNorm is needed in the backward only for its saved mean and inverse
    std (its output feeds the residual add): recompute holds those from the forward and does
    not re-run it; every other BatchNorm is re-run for its output, its statistics still held.
    Bit-identical to no recompute (tiny ResNet-50 depths, 2 SGD steps)."""
    resnet = programs.get("resnet")
    module = resnet.build("tiny", seed=0, depths=(3, 4, 6, 3))
    base = export_cache.export(module, resnet.example_inputs("tiny", 4, depths=(3, 4, 6, 3)), name="resnet")
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(base.loss)
    plan = plan_recompute(base, checkpoints=FLEET_RESNET_NAMES)
    rerun = {
        base.ops[i].scope for s in plan.segments for i in s.ops if base.ops[i].type == "BatchNormTraining"
    }
    assert rerun and not any(sc.endswith(("branch2c.bn", "branch1.bn")) for sc in rerun)
    assert any(sc.endswith("branch2b.bn") for sc in rerun)
    q = recompute(base, checkpoints=FLEET_RESNET_NAMES)
    grads = [op for op in q.ops if op.type == "BatchNormTrainingGrad"]
    recomputed = {o for op in q.ops if op.role == "recompute" for o in op.outputs}
    assert grads and not any(x in recomputed for op in grads for x in op.inputs[3:5])  # the forward's
    feeds = [
        dict(
            zip(
                resnet.INPUT_NAMES, resnet.example_inputs("tiny", 4, seed=s, depths=(3, 4, 6, 3)), strict=True
            )
        )
        for s in range(2)
    ]
    outs = []
    for program in (base, q):
        exe = metaopt.Executor("cpu")
        outs.append(
            [exe.run(program, feed=f, fetch_list=[program.loss], return_numpy=False)[0] for f in feeds]
        )
        outs[-1].append(dict(exe.scope))
    assert all(torch.equal(a, b) for a, b in zip(outs[0][:2], outs[1][:2]))
    assert all(torch.equal(outs[0][2][k], outs[1][2][k]) for k in outs[0][2])


@pytest.mark.parametrize(
    "typo, suggested, family",
    [
        ("bert.encoder.layers", "bert.encoder.layer.1", "bert.encoder.layer.*"),
        ("bert.encoder.layer.0.atention", "bert.encoder.layer.0.attention", "bert.encoder.layer.*.attention"),
    ],
)
def test_an_unknown_checkpoint_suggests_names_once_each_and_the_pattern_of_their_family(
    typo, suggested, family
):
    """Issue 32: the did-you-mean listed a module twice (a module and its output var share the
    name) and never the pattern a checkpoint list wants; the pattern suggested resolves."""
    _, _, program = exported("bert")
    with pytest.raises(RecomputeError) as e:
        resolve_checkpoints(program, [typo])
    text = str(e.value)
    assert f"'{suggested}'" in text and text.endswith(f"; every block of that family: '{family}'")
    quoted = text[text.index("did you mean") :].split("?")[0]
    names = [q for q in quoted.split("'")[1::2]]
    assert len(names) == len(set(names))  # each once
    assert resolve_checkpoints(program, [family])  # the suggestion is a working checkpoint entry

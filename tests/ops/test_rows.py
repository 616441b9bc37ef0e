"""Per-op knowledge in the op-table rows: AMP classes, skip inputs, shape-value and fusion rules,
train-mode repairs, collectives (each row field that passes read instead of switching on types)."""

from __future__ import annotations

import inspect

import pytest
import torch

from metaopt.ir import Op, Program, Var
from metaopt.ops import registry
from metaopt.ops.registry import AMP_CLASSES, ShapeArgs, register


def _positional(row: registry.OpDef) -> list[str]:
    return [
        p.name
        for p in inspect.signature(row.kernel).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


# --- skip_input / update ---------------------------------------------------------------------


def test_update_rows_have_a_skip_input_at_their_found_inf():
    table = registry.table()
    updates = {t for t, row in table.items() if row.update}
    assert updates == {
        "SGDUpdate",
        "MomentumUpdate",
        "AdamUpdate",
        "AdamWUpdate",
        "LambUpdate",  # ops/kernels/layerwise.py
        "LarsMomentumUpdate",
    }
    skipping = {t for t, row in table.items() if row.skip_input is not None}
    assert skipping == updates | {"StepCounter"}
    for t in skipping:
        row = table[t]
        # the index the AMP pass writes found_inf at is the kernel's found_inf parameter
        assert _positional(row)[row.skip_input] == "found_inf", t
        assert registry.skip_input(t) == row.skip_input
    assert registry.is_update("AdamUpdate") and not registry.is_update("StepCounter")
    assert registry.skip_input("Relu") is None and registry.skip_input("NoSuchOp") is None
    assert not registry.is_update("NoSuchOp")


def test_an_update_row_without_skip_input_is_refused():
    with pytest.raises(ValueError, match="update op needs a skip_input"):
        register("BadUpdateForTest", update=True)(lambda p, g, lr: p)


# --- AMP ---------------------------------------------------------------------------------------


def test_amp_fields():
    table = registry.table()
    assert {row.amp for row in table.values()} <= set(AMP_CLASSES)
    white, black = registry.amp_types("white"), registry.amp_types("black")
    assert white == {
        "Attention",
        "Conv",
        "ConvTranspose",
        "Einsum",
        "Gemm",
        "GroupedMatMul",
        "Linear",
        "LinearCrossEntropy",
        "MatMul",
        "ScaledDotProductAttention",
        "RingAttention",  # context parallel's attention, as ScaledDotProductAttention
        "VocabParallelLinearCrossEntropy",
    }
    assert not white & black and {"Softmax", "ReduceSum", "Exp"} <= black
    assert "ReduceMax" not in black  # exact in any dtype: gray
    assert {t for t, row in table.items() if row.sets_dtype} == {"Cast", "CastLike"}
    for t, row in table.items():
        if t in ("LinearCrossEntropy", "VocabParallelLinearCrossEntropy"):  # white matmul, float32 loss
            assert row.amp_float32_outputs == (0,) and not row.amp_float32_inputs
        elif row.amp_float32_inputs or row.amp_float32_outputs:
            assert row.amp == "gray", t  # float32 statistics in an op that follows its inputs
            assert max(row.amp_float32_inputs) < len(_positional(row)), t
    assert table["LayerNormalization"].amp_float32_inputs == (1, 2)
    with pytest.raises(ValueError, match="amp class"):
        registry.amp_types("grey")
    with pytest.raises(ValueError, match="amp must be one of"):
        register("BadAmpForTest", amp="grey")(lambda x: x)


def test_amp_names_are_views_of_the_rows():
    from metaopt.passes import amp

    assert amp.WHITE_LIST == registry.amp_types("white")
    assert amp.BLACK_LIST == registry.amp_types("black")
    assert amp.DTYPE_SETTING == {"Cast", "CastLike"}
    assert amp.FLOAT32_SLOTS == {
        "LayerNormalization": ((1, 2), (1, 2)),
        "BatchNormTraining": ((1, 2, 3, 4),) * 2,
        "LinearCrossEntropy": ((), (0,)),  # low-precision matmul, float32 loss
        "VocabParallelLinearCrossEntropy": ((), (0,)),  # the same over this rank's vocab rows
    }


# --- shape values and static targets (fold_constants) -------------------------------------------


def _args(op_type: str, values, tracked=None, shapes=None, **attrs) -> tuple[list, bool] | None:
    n = len(values)
    args = ShapeArgs(attrs, list(values), list(tracked or [None] * n), list(shapes or [None] * n))
    return registry.get(op_type).shape_value(args)


def test_shape_value_rules():
    table = registry.table()
    with_rule = {t for t, row in table.items() if row.shape_value is not None}
    assert with_rule == {"Shape", "Size", "Gather", "Slice", "Concat", "Squeeze", "Unsqueeze"}
    s = (["batch", 4, 8], False)
    assert _args("Shape", [None], shapes=[("batch", 4, 8)], start=1) == ([4, 8], False)
    assert _args("Size", [None], shapes=[(2, 3)]) == ([6], True)
    assert _args("Size", [None], shapes=[("batch", 3)]) is None  # no symbolic products
    assert _args("Gather", [s, ([2], True)], tracked=[s, None]) == ([8], True)
    assert _args("Gather", [s, ([2], True)], tracked=[None, None]) is None  # a constant: the kernel folds it
    sl = [s, ([0], False), ([1], False), ([0], False)]
    assert _args("Slice", sl, tracked=[s, None, None, None]) == (["batch"], False)
    assert _args("Concat", [s, ([-1], False)], tracked=[s, None], axis=0) == (["batch", 4, 8, -1], False)
    one = (["batch"], False)
    assert _args("Squeeze", [one], tracked=[one]) == (["batch"], True)
    assert _args("Unsqueeze", [one], tracked=[one]) == (["batch"], False)


def test_static_target_rules():
    table = registry.table()
    assert {t for t, row in table.items() if row.static_target is not None} == {"Reshape", "Expand"}
    reshape, expand = table["Reshape"].static_target, table["Expand"].static_target
    assert reshape({}, ("4*batch", 8), None) == ([-1, 8], {"allowzero": 0})
    assert reshape({}, ("batch", "seq"), None) is None  # two symbolic dims: no single -1
    assert expand({}, ("batch", 4, 8), ("batch", 1, 8)) == ([1, 4, 8], {})
    assert expand({}, ("batch", 4), ("other", 4)) is None  # the symbol does not come from the input


# --- fusion, repairs, collectives ----------------------------------------------------------------


def test_matmul_fuse_rule_matches_the_exported_linear():
    # Linear, and the GELU chains' anchors (tests/passes/test_fuse.py); attention has its own.
    assert {"MatMul", "Tanh", "Erf"} <= {t for t, row in registry.table().items() if row.fuse is not None}
    p = Program("t")
    p.add_var(Var("x", "float32", ("batch", 8), kind="input"))
    p.add_var(Var("W", "float32", (16, 8), kind="param", trainable=True), torch.zeros(16, 8))
    p.add_var(Var("b", "float32", (16,), kind="param", trainable=True), torch.zeros(16))
    for n, s in (("wt", (8, 16)), ("xw", ("batch", 16)), ("y", ("batch", 16))):
        p.add_var(Var(n, "float32", s))
    p.inputs, p.outputs = ["x"], ["y"]
    p.ops = [
        Op("Transpose", ["W"], ["wt"], {"perm": [1, 0]}),
        Op("MatMul", ["x", "wt"], ["xw"]),
        Op("Add", ["b", "xw"], ["y"], scope="fc"),
    ]
    absorbed, fused = registry.get("MatMul").fuse(p, 1, p.producers(), p.consumers())
    assert sorted(absorbed) == [0, 2]
    assert (fused.type, fused.inputs, fused.outputs, fused.scope) == ("Linear", ["x", "W", "b"], ["y"], "fc")
    p.ops[2].type = "Sub"  # no bias to take: the product alone is Linear(x, W)
    absorbed, fused = registry.get("MatMul").fuse(p, 1, p.producers(), p.consumers())
    assert absorbed == [0] and (fused.type, fused.inputs, fused.outputs) == ("Linear", ["x", "W"], ["xw"])
    p.vars["W"].kind = "activation"  # a transposed activation is real work: left alone
    assert registry.get("MatMul").fuse(p, 1, p.producers(), p.consumers()) is None


def test_train_repairs_and_collectives():
    table = registry.table()
    repairs = {t: row.train_repair for t, row in table.items() if row.train_repair}
    assert repairs == {"Dropout": "training_mode_input", "BatchNormalization": "batch_norm_training"}
    assert _positional(table["Dropout"])[2] == "training_mode"
    with pytest.raises(ValueError, match="train_repair"):
        register("BadRepairForTest", train_repair="nope")(lambda x: x)
    collectives = {t for t, row in table.items() if row.collective}
    # Broadcast: the startup op of data parallel; TPReduce: tensor parallel's forward all-reduce;
    # PartitionGather: recompute partition's all-gather of a checkpoint's slices;
    # VocabParallelLinearCrossEntropy: the vocab-parallel loss's all-reduce of its logsumexps
    assert collectives == {
        "AllReduce",
        "Broadcast",
        "TPReduce",
        "PartitionGather",
        "VocabParallelLinearCrossEntropy",
        "ReduceScatter",  # ZeRO sharding's (ops/kernels/zero.py)
        "ShardGather",
        "ShardedClipByGlobalNorm",
        "LocalSGDAverage",  # local SGD's (passes/local_sgd.py)
        "ExpertRoute",  # expert parallel's all-to-alls (ops/kernels/expert_parallel.py)
        "ExpertExchange",
        "SPGather",  # sequence parallel's (ops/kernels/sequence_parallel.py; SPScatter is local)
        "SPReduceScatter",
        "SepAllToAll",  # segment parallel's exchange around attention (ops/kernels/segment_parallel.py)
        "FeedsAgree",  # and its first-run check that the sep group was fed one batch
        "RingAttention",  # context parallel's ring (ops/kernels/context_parallel.py) and its grad
        "RingAttentionGrad",
        "RngReplayCollective",  # recompute's replay of a random op that communicates (the ring)
    }
    assert all(table[t].needs_runtime for t in collectives)  # they run through the communicator
    assert "ranks" in inspect.signature(table["AllReduce"].kernel).parameters


# --- cost (the pipeline balancer's estimate) ---------------------------------------------------


def _costed() -> Program:
    p = Program("costed")
    p.add_var(Var("x", "float32", ("batch", 8), "input"))
    p.add_var(Var("w", "float32", (8, 4), "param"), torch.zeros(8, 4))
    p.add_var(Var("s", "int64", (2,), "constant"), torch.tensor([-1, 4]))
    for name, shape in [("h", ("batch", 4)), ("r", ("batch", 4)), ("v", ("batch", 4))]:
        p.add_var(Var(name, "float32", shape))
    p.inputs = ["x"]
    p.ops = [Op("MatMul", ["x", "w"], ["h"]), Op("Relu", ["h"], ["r"]), Op("Reshape", ["r", "s"], ["v"])]
    return p


def test_default_cost_counts_params_twice_and_output_bytes_and_views_nothing():
    p = _costed()
    matmul, relu, reshape = p.ops
    assert registry.get("Reshape").view and registry.get("Reshape").cost is None
    assert registry.op_cost(p, matmul) == 2 * 8 * 4 * 4 + 4 * 4  # batch bound to 1
    assert registry.op_cost(p, relu) == 4 * 4
    assert registry.op_cost(p, reshape) == 0.0


def test_a_rows_cost_rule_replaces_the_default(monkeypatch):
    p = _costed()
    row = registry.get("Relu")
    costed = registry.OpDef(**{**row.__dict__, "cost": lambda q, op: 123})
    monkeypatch.setitem(registry._TABLE, "Relu", costed)
    assert registry.op_cost(p, p.ops[1]) == 123.0

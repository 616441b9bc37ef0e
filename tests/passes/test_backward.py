"""append_backward: every rule against torch autograd, the reference programs, names, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt.ir import Op, Program, Var, dtype_name, verify
from metaopt.ops import registry
from metaopt.passes.backward import BackwardError, append_backward

# --- one op at a time -------------------------------------------------------------


def _single_op(op_type, inputs, attrs=None, *, params=None, n_out=1, consts=None):
    """loss = sum(out0 * w): float inputs listed in `params` are trainable params."""
    p = Program("single")
    params = set(range(len(inputs))) if params is None else set(params)
    names_ = []
    for i, t in enumerate(inputs):
        name = f"in{i}"
        kind = "param" if i in params else "constant" if consts and i in consts else "input"
        if kind == "constant":
            p.add_var(Var(name, dtype_name(t.dtype), tuple(t.shape), kind="constant"), t)
        else:
            p.add_var(
                Var(name, dtype_name(t.dtype), tuple(t.shape), kind=kind, trainable=kind == "param"),
                t if kind == "param" else None,
            )
            if kind == "input":
                p.inputs.append(name)
        names_.append(name)
    row = registry.get(op_type)
    kw = dict(attrs or {})
    if row.needs_outputs:
        kw["_nout"] = n_out
    out = row.kernel(*inputs, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    out_names = [f"out{k}" for k in range(n_out)]
    for name, t in zip(out_names, outs):
        p.add_var(Var(name, dtype_name(t.dtype), tuple(t.shape)))
    w = torch.randn(outs[0].shape, dtype=outs[0].dtype, generator=torch.Generator().manual_seed(5))
    p.add_var(Var("w", dtype_name(w.dtype), tuple(w.shape), kind="constant"), w)
    for n, s in (("weighted", tuple(outs[0].shape)), ("loss", ())):
        p.add_var(Var(n, dtype_name(w.dtype), s))
    p.ops = [
        Op(op_type, names_, out_names, dict(attrs or {})),
        Op("Mul", ["out0", "w"], ["weighted"]),
        Op("ReduceSum", ["weighted"], ["loss"], {"keepdims": 0}, role="loss"),
    ]
    p.outputs, p.loss_name = ["loss"], "loss"
    verify(p)
    return p, w


def _check_against_autograd(op_type, inputs, attrs=None, *, params=None, n_out=1, consts=None, tol=1e-10):
    p, w = _single_op(op_type, inputs, attrs, params=params, n_out=n_out, consts=consts)
    q, pg = append_backward(p, loss="loss")
    verify(q)
    feed = {n: inputs[int(n[2:])] for n in p.inputs}
    got = metaopt.Executor().run(q, feed=feed, fetch_list=[g for _, g in pg], return_numpy=False)
    row = registry.get(op_type)
    kw = dict(attrs or {})
    if row.needs_outputs:
        kw["_nout"] = n_out
    xs = [t.clone().requires_grad_(True) if f"in{i}" in dict(pg) else t for i, t in enumerate(inputs)]
    out = row.kernel(*xs, **kw)
    out0 = out[0] if isinstance(out, tuple) else out
    wanted = [xs[int(pn[2:])] for pn, _ in pg]
    ref = torch.autograd.grad((out0 * w).sum(), wanted)
    assert len(got) == len(ref) > 0
    for (pn, _), a, b in zip(pg, got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, (pn, a.shape, b.shape)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{op_type}: grad of {pn}")
    return q


def r(*shape, dtype=torch.float64, seed=0):
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed + sum(shape)))


# float64 so the comparison is against the math, not against one rounding order.
BROADCAST = [((3, 4, 5), (5,)), ((3, 4, 5), (4, 1)), ((3, 1, 5), (1, 4, 5)), ((3, 4), (3, 4)), ((2, 3), ())]


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shapes", BROADCAST, ids=str)
def test_binary_with_broadcasting(op_type, shapes):
    a, b = r(*shapes[0]), r(*shapes[1], seed=1)
    if op_type == "Div":
        b = b.abs() + 0.5
    _check_against_autograd(op_type, [a, b])


@pytest.mark.parametrize("op_type", ["Relu", "Tanh", "Sigmoid", "Neg", "Identity"])
def test_unary(op_type):
    _check_against_autograd(op_type, [r(4, 7)])


@pytest.mark.parametrize("exponent", [3.0, 2.0, 0.5, -1.0, 0.0])
def test_pow_scalar_exponent_takes_the_scalar_form(exponent):
    # A constant scalar exponent: PowGrad (n * x**(n-1)), not the generic Vjp, whose tensor-
    # exponent backward also forms log(x) and a where() (the 10x `aten::pow`).
    x = r(4, 7).abs() + 0.5
    n = torch.tensor(exponent, dtype=torch.float64)
    q = _check_against_autograd("Pow", [x, n], params=[0], consts={1})
    assert "PowGrad" in [op.type for op in q.ops] and not _vjp_of(q, "Pow")


def test_pow_tensor_exponent_keeps_the_general_rule():
    # An exponent that needs a grad (a param) has a log term: the generic rule handles it.
    q = _check_against_autograd("Pow", [r(4, 7).abs() + 0.5, r(4, 7, seed=1)])
    assert _vjp_of(q, "Pow")


@pytest.mark.parametrize("op_type", ["Sqrt", "Exp", "Log"])
def test_unary_rules_from_saved_values(op_type):
    # Cheap forms as torch's: from the saved output (Sqrt, Exp) or input (Log), no Vjp re-run.
    q = _check_against_autograd(op_type, [r(4, 7).abs() + 0.5])
    assert not _vjp_of(q, op_type)


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 3, 4), ())], ids=str)
def test_where_rule_with_broadcasting(shapes):
    a, b = r(*shapes[0]), r(*shapes[1], seed=1)
    cond = r(*shapes[0], seed=2) > 0
    q = _check_against_autograd("Where", [cond, a, b], params=[1, 2])
    assert not _vjp_of(q, "Where")


def _vjp_of(q, op_type: str) -> list:
    """The generic-rule ops computing `op_type`'s grads (the loss's ReduceSum has one too)."""
    return [op for op in q.ops if op.type == "Vjp" and op.attrs["op"] == op_type]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    _check_against_autograd("Gelu", [r(4, 7)], {"approximate": approximate})


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax(op_type, axis):
    _check_against_autograd(op_type, [r(2, 5, 3)], {"axis": axis})


def test_cast_to_same_family():
    _check_against_autograd("Cast", [r(3, 4)], {"to": 11})


@pytest.mark.parametrize(
    "op_type,attrs,extra",
    [
        ("Reshape", {}, [torch.tensor([6, -1])]),
        ("Flatten", {"axis": 2}, []),
        ("Squeeze", {}, [torch.tensor([1])]),
        ("Unsqueeze", {}, [torch.tensor([0])]),
        ("Transpose", {"perm": [2, 0, 1]}, []),
        ("Transpose", {}, []),
    ],
)
def test_shape_ops(op_type, attrs, extra):
    x = r(3, 1, 4) if op_type == "Squeeze" else r(3, 2, 4)
    _check_against_autograd(op_type, [x, *extra], attrs, params=[0], consts=set(range(1, 1 + len(extra))))


def test_split_and_concat():
    _check_against_autograd(
        "Split", [r(4, 6), torch.tensor([2, 4])], {"axis": 1}, params=[0], consts={1}, n_out=2
    )
    _check_against_autograd("Concat", [r(2, 3), r(2, 5, seed=2)], {"axis": 1})


@pytest.mark.parametrize(
    "bounds",
    [
        ([1], [4], [1]),  # one axis
        ([0, -3], [2, 2**62], [0, -1]),  # several axes, a negative start, an end past the dim
        ([2], [-1], None),  # no axes: the first ones
        ([4], [1], [1]),  # empty: the grad is all zeros
    ],
    ids=str,
)
def test_slice_pads_the_grad_back(bounds):
    starts, ends, axes = bounds
    extra = [torch.tensor(starts), torch.tensor(ends)] + ([torch.tensor(axes)] if axes else [])
    q = _check_against_autograd(
        "Slice", [r(5, 6), *extra], {}, params=[0], consts=set(range(1, 1 + len(extra)))
    )
    assert [op.type for op in q.ops if op.role == "backward"].count("Pad") == 1
    assert not any(op.type == "Vjp" and op.attrs["op"] == "Slice" for op in q.ops)


def test_slice_of_a_whole_symbolic_dim_passes_the_grad_through():
    # x[:, 1:4] exported with the batch dim symbolic: axis 0 taken whole (0 to INT64_MAX) needs
    # no size, axis 1 is static
    bounds = [torch.tensor([0, 1]), torch.tensor([2**63 - 1, 4]), torch.tensor([0, 1])]
    p, _ = _single_op("Slice", [r(5, 6), *bounds], {}, params=[0], consts={1, 2, 3})
    for name in ("in0", "out0", "weighted"):
        p.vars[name].shape = ("batch", *p.vars[name].shape[1:])
    q, _ = append_backward(p, loss="loss")
    (pad,) = [op for op in q.ops if op.type == "Pad"]
    assert q.values[pad.inputs[1]].tolist() == [0, 1, 0, 2] and q.values[pad.inputs[3]].tolist() == [0, 1]
    bounds[0][1], bounds[1][1] = 0, 2**63 - 1  # both axes whole: the grad as it came, no op of its own
    p, _ = _single_op("Slice", [r(5, 6), *bounds], {}, params=[0], consts={1, 2, 3})
    q, pg = append_backward(p, loss="loss")
    assert not any(op.origin == "out0" for op in q.ops)
    assert [op.type for op in q.ops if op.outputs == [dict(pg)["in0"]]] == ["Identity"]  # the name only


@pytest.mark.parametrize(
    "x_shape,shape", [((3, 1, 4), [3, 5, 4]), ((4,), [2, 3, 4]), ((2, 1), [1, 3]), ((2, 3), [2, 3])], ids=str
)
def test_expand_sums_the_broadcast_dims(x_shape, shape):
    q = _check_against_autograd("Expand", [r(*x_shape), torch.tensor(shape)], {}, params=[0], consts={1})
    assert not any(op.type == "Vjp" and op.attrs["op"] == "Expand" for op in q.ops)


def test_linear_any_rank():
    _check_against_autograd("Linear", [r(2, 3, 8), r(5, 8, seed=1), r(5, seed=2)])
    _check_against_autograd("Linear", [r(4, 8), r(5, 8, seed=1), r(5, seed=2)])


@pytest.mark.parametrize(
    "shapes",
    [
        ((3, 4), (4, 5)),
        ((2, 3, 4), (4, 5)),
        ((2, 3, 4), (2, 4, 5)),
        ((2, 1, 3, 4), (5, 4, 6)),
        ((4,), (4, 5)),
    ],
    ids=str,
)
def test_matmul(shapes):
    _check_against_autograd("MatMul", [r(*shapes[0]), r(*shapes[1], seed=3)])


@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(ta, tb):
    a = r(4, 3) if ta else r(3, 4)
    b = r(5, 4) if tb else r(4, 5)
    _check_against_autograd(
        "Gemm", [a, b, r(5, seed=4)], {"transA": ta, "transB": tb, "alpha": 0.5, "beta": 2.0}
    )


def test_embedding_gather():
    ids = torch.tensor([[1, 3, 3], [0, 9, 1]])
    _check_against_autograd("Gather", [r(10, 4), ids], {"axis": 0}, params=[0])


def test_layer_norm():
    _check_against_autograd("LayerNormalization", [r(2, 3, 8), r(8, seed=1), r(8, seed=2)], {"epsilon": 1e-5})


def test_batch_norm_training():
    x, s, b = r(4, 3, 5, 5), r(3, seed=1), r(3, seed=2)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    _check_against_autograd(
        "BatchNormTraining",
        [x, s, b, rm, rv],
        {"epsilon": 1e-5, "momentum": 0.1},
        params=[0, 1, 2],
        consts={3, 4},
    )


@pytest.mark.parametrize(
    "attrs",
    [{"pads": [1, 1, 1, 1], "strides": [2, 2]}, {"group": 2, "dilations": [2, 2]}, {"pads": [0, 1, 1, 0]}],
)
def test_conv(attrs):
    _check_against_autograd(
        "Conv", [r(2, 4, 7, 7), r(6, 2 if attrs.get("group") else 4, 3, 3, seed=1), r(6, seed=2)], attrs
    )


@pytest.mark.parametrize(
    "attrs", [{"reduction": "mean"}, {"reduction": "sum"}, {"reduction": "mean", "ignore_index": 1}]
)
def test_softmax_cross_entropy(attrs):
    labels = torch.tensor([0, 4, 1, 1, 2, 3])
    q = _check_against_autograd("SoftmaxCrossEntropyLoss", [r(6, 5), labels], attrs, params=[0], consts={1})
    assert any(op.type == "SoftmaxCrossEntropyLossGrad" for op in q.ops)
    # [N, C, d] scores: classes on axis 1, as ONNX and torch agree.
    labels3 = torch.tensor([[0, 4, 1], [1, 2, 3]])
    _check_against_autograd("SoftmaxCrossEntropyLoss", [r(2, 5, 3), labels3], attrs, params=[0], consts={1})


def test_dropout_reuses_the_forward_mask():
    x = r(64, 32)
    p, w = _single_op(
        "Dropout", [x, torch.tensor(0.5, dtype=torch.float64), torch.tensor(True)], params=[0], consts={1, 2}
    )
    q, pg = append_backward(p, loss="loss")
    drop = next(op for op in q.ops if op.type == "Dropout")
    assert len(drop.outputs) == 2 and q.vars[drop.outputs[1]].dtype == "bool"
    metaopt.seed(0)
    out, mask, g = metaopt.Executor().run(
        q, fetch_list=["out0", drop.outputs[1], pg[0][1]], return_numpy=False
    )
    assert torch.equal(g, w * mask * 2.0)
    assert torch.equal(out, x * mask * 2.0)


@pytest.mark.parametrize(
    "op_type,inputs,attrs",
    [
        # (MaxPool has its own rule now: tests/ops/test_max_pool_grad.py)
        ("LpPool", [r(2, 3, 6, 6)], {"kernel_shape": [2, 2], "strides": [2, 2], "p": 2}),
        ("ReduceProd", [r(3, 4, 5), torch.tensor([1])], {"keepdims": 0}),
        # Pow's tensor-exponent case (test_pow_tensor_exponent_keeps_the_general_rule) too.
        # a negative step (a flip): neither the Pad form nor SliceGrad applies
        ("Slice", [r(5, 6), torch.tensor([4]), torch.tensor([0]), torch.tensor([1]), torch.tensor([-2])], {}),
    ],
)
def test_generic_vjp_rule(op_type, inputs, attrs):
    params = [i for i, t in enumerate(inputs) if t.is_floating_point() and (op_type != "Pow" or i == 0)]
    consts = set(range(len(inputs))) - set(params)
    q = _check_against_autograd(op_type, inputs, attrs, params=params, consts=consts)
    assert any(op.type == "Vjp" and op.attrs["op"] == op_type for op in q.ops)


# --- whole programs -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt", "resnet"])
def test_reference_program_grads_match_torch_autograd(name):
    module, _, program = exported(name)
    q, params_grads = append_backward(program, loss=program.loss_name)
    verify(q)
    mod = programs.get(name)
    inputs = mod.example_inputs("tiny", 3, seed=11)
    exe = metaopt.Executor()
    got = exe.run(
        q,
        feed=dict(zip(mod.INPUT_NAMES, inputs, strict=True)),
        fetch_list=[g for _, g in params_grads],
        return_numpy=False,
    )
    ref_module = mod.build("tiny", seed=0, dropout=0.0)
    ref_module(*programs.channels_last(inputs)).backward()  # the program's conv layout
    ref = dict(ref_module.named_parameters())
    assert {p for p, _ in params_grads} == set(ref)
    for (pn, _), g in zip(params_grads, got):
        # The bar for float32 CPU; mlp and resnet come out bitwise, bert/gpt ~1e-7.
        torch.testing.assert_close(g, ref[pn].grad, rtol=1e-5, atol=1e-6, msg=pn)


def test_names_roles_origins_and_sums():
    _, _, program = exported("bert")
    before = str(program)
    q, params_grads = append_backward(program, loss="loss")
    assert str(program) == before  # pure
    for p, g in params_grads:
        assert g == f"{p}@GRAD" and q.vars[g].shape == q.vars[p].shape
    bw = [op for op in q.ops if op.role == "backward"]
    assert bw and all(op.origin for op in bw)
    # The embedding output feeds three attention projections: its grad is an explicit sum.
    sums = [op for op in bw if op.type in ("GradSum", "GradAccumulate")]
    assert any(op.outputs == ["bert.embeddings@GRAD"] for op in sums)
    # Integer paths carry no grad.
    assert not any(n.startswith("input_ids@GRAD") or n.startswith("attention_mask@GRAD") for n in q.vars)


def test_parameter_list_and_no_grad_set():
    _, _, program = exported("mlp")
    q, pg = append_backward(program, loss="loss", parameter_list=["fc3.weight", "fc3.bias"])
    assert [p for p, _ in pg] == ["fc3.weight", "fc3.bias"]
    assert not any(
        op.type == "LinearGrad" or op.type == "Gemm" and op.role == "backward" and "fc1" in op.scope
        for op in q.ops
    )
    # Paddle's no_grad_set stops the gradient at a var: nothing upstream of fc2's output
    # (fc2's own params included) gets a grad; naming a param leaves just that one out.
    q, pg = append_backward(program, loss="loss", no_grad_set={"fc2"})
    assert {p for p, _ in pg} == {"fc3.weight", "fc3.bias"}
    q, pg = append_backward(program, loss="loss", no_grad_set={"fc1.weight"})
    assert {p for p, _ in pg} == {"fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"}


def test_errors_name_the_culprit():
    _, _, program = exported("mlp")
    with pytest.raises(BackwardError, match=r"parameter 'fc1.wieght'.*did you mean 'fc1.weight'"):
        append_backward(program, loss="loss", parameter_list=["fc1.wieght"])
    with pytest.raises(BackwardError, match="must be a floating scalar"):
        append_backward(program, loss="fc1")
    q, _ = append_backward(program, loss="loss")
    with pytest.raises(BackwardError, match="already has backward ops"):
        append_backward(q, loss="loss")
    p, _ = _single_op("Bernoulli", [torch.rand(3, 4, dtype=torch.float64)], params=[0])
    with pytest.raises(BackwardError, match=r"random op Bernoulli.*out0 = Bernoulli\(in0\)"):
        append_backward(p, loss="loss")


def test_grads_of_a_program_with_dropout_are_seeded_and_consistent():
    _, _, program = exported("gpt", dropout=0.3)
    q, pg = append_backward(program, loss="loss")
    mod = programs.get("gpt")
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 2, seed=1), strict=True))
    exe = metaopt.Executor()
    runs = []
    for _ in range(2):
        metaopt.seed(7)
        runs.append(exe.run(q, feed=feed, fetch_list=[g for _, g in pg]))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_tied_weight_grad_accumulates_into_the_fresh_contribution():
    _, _, program = exported("gpt")
    q, pg = append_backward(program, loss="loss")
    (acc,) = [op for op in q.ops if op.outputs == ["transformer.wte.weight@GRAD"]]
    # One contribution is new storage (the LM head's LinearGrad makes it first) and the other
    # (the embedding's) is added into it in place, as torch's AccumulateGrad does; the result
    # stays contiguous.
    assert acc.type == "GradAccumulate" and len(acc.inputs) == 2
    producer = next(op for op in q.ops if acc.inputs[0] in op.outputs)
    assert registry.get(producer.type).fresh_outputs and producer.type == "LinearGrad"
    mod = programs.get("gpt")
    feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 2, seed=1), strict=True))
    exe = metaopt.Executor()
    (g,) = exe.run(q, feed=feed, fetch_list=["transformer.wte.weight@GRAD"], return_numpy=False)
    assert g.is_contiguous()


def test_shared_contribution_is_never_accumulated_into():
    """Add passes its output grad to both inputs: that one tensor must not be written."""
    x = r(3, 4)
    p, w = _single_op("Add", [x, x.clone()], params=[0, 1])
    # y = a + b; loss = sum(y * w): both grads are w, from the same dy tensor.
    q, pg = append_backward(p, loss="loss")
    assert not any(op.type == "GradAccumulate" for op in q.ops)
    got = metaopt.Executor().run(q, fetch_list=[g for _, g in pg], return_numpy=False)
    assert all(torch.equal(t, w) for t in got)


def test_one_var_used_twice_by_an_op_gets_both_contributions():
    p = Program("twice")
    p.add_var(
        Var("w", "float64", (3,), kind="param", trainable=True),
        torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
    )
    for n in ("s", "d"):
        p.add_var(Var(n, "float64", (3,)))
    p.add_var(Var("loss", "float64", ()))
    p.ops = [
        Op("Add", ["w", "w"], ["s"]),
        Op("Mul", ["s", "w"], ["d"]),
        Op("ReduceSum", ["d"], ["loss"], {"keepdims": 0}, role="loss"),
    ]
    p.outputs, p.loss_name = ["loss"], "loss"
    q, pg = append_backward(p, loss="loss")
    (g,) = metaopt.Executor().run(q, fetch_list=[pg[0][1]])
    # loss = sum(2w * w) = 2 sum(w^2): grad 4w
    assert g.tolist() == [4.0, 8.0, 12.0]


def test_dropout_with_a_run_time_training_flag():
    x = r(16, 8)
    p, w = _single_op(
        "Dropout", [x, torch.tensor(0.5, dtype=torch.float64), torch.tensor(True)], params=[0], consts={1}
    )
    q, pg = append_backward(p, loss="loss")
    drop = next(op for op in q.ops if op.type == "Dropout")
    exe = metaopt.Executor()
    for train in (True, False):
        metaopt.seed(0)
        out, mask, g = exe.run(
            q,
            feed={"in2": torch.tensor(train)},
            fetch_list=["out0", drop.outputs[1], pg[0][1]],
            return_numpy=False,
        )
        want = w * mask * 2.0 if train else w
        assert torch.equal(g, want), train


def test_unknown_no_grad_set_entry_is_an_error():
    _, _, program = exported("mlp")
    with pytest.raises(BackwardError, match=r"no_grad_set entry 'fc1.wieght'.*did you mean 'fc1.weight'"):
        append_backward(program, loss="loss", no_grad_set={"fc1.wieght"})


def _no_vjp(q, op_type):
    assert not any(op.type == "Vjp" and op.attrs["op"] == op_type for op in q.ops), op_type


@pytest.mark.parametrize("op_type", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([1], 0), ([0, -1], 0), (None, 0), ([2, 0], 1)], ids=str)
def test_reduce_sum_and_mean_broadcast_the_grad_back(op_type, axes, keepdims):
    extra = [torch.tensor(axes)] if axes is not None else []
    q = _check_against_autograd(
        op_type, [r(3, 4, 5), *extra], {"keepdims": keepdims}, params=[0], consts={1} if extra else None
    )
    _no_vjp(q, op_type)


def test_reduce_l2_is_zero_where_the_norm_is_zero():
    x = r(4, 5)
    x[2] = 0.0  # a zero row: torch's norm backward gives it a zero grad, not nan
    for keepdims in (0, 1):
        attrs = {"keepdims": keepdims}
        q = _check_against_autograd("ReduceL2", [x, torch.tensor([1])], attrs, params=[0], consts={1})
        _no_vjp(q, "ReduceL2")


@pytest.mark.parametrize("bounds", ["both", "min", "max"])
def test_clip_passes_the_grad_inside_its_bounds(bounds):
    x = r(4, 6)
    x[0, 0], x[1, 1] = -0.5, 0.5  # exactly on a bound: inside (torch.clamp's backward)
    lo, hi = torch.tensor(-0.5, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
    if bounds == "max":  # clamp(max=): the min input omitted ("")
        p, w = _single_op("Clip", [x, lo, hi], params=[0], consts={1, 2})
        p.ops[0].inputs[1] = ""
        q, pg = append_backward(p, loss="loss")
        (got,) = metaopt.Executor().run(q, feed={}, fetch_list=[dict(pg)["in0"]], return_numpy=False)
        xg = x.clone().requires_grad_(True)
        (want,) = torch.autograd.grad((torch.clamp(xg, max=0.5) * w).sum(), [xg])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        ins = [x, lo, hi] if bounds == "both" else [x, lo]
        q = _check_against_autograd("Clip", ins, params=[0], consts=set(range(1, len(ins))))
    _no_vjp(q, "Clip")


@pytest.mark.parametrize("index,axis", [(0, 1), (-1, 1), (2, 0), (3, -1)])
def test_gather_of_one_constant_index_pads_the_grad_back(index, axis):
    q = _check_against_autograd(
        "Gather", [r(3, 4, 5), torch.tensor(index)], {"axis": axis}, params=[0], consts={1}
    )
    _no_vjp(q, "Gather")


def test_cast_like_casts_the_grad_back():
    x, like = r(3, 4, dtype=torch.float32), r(1, dtype=torch.float64)
    q = _check_against_autograd("CastLike", [x, like], params=[0], consts={1}, tol=1e-6)
    _no_vjp(q, "CastLike")


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("td,dnh->tnh", [(5, 4), (4, 2, 3)]),  # HF Funnel's relative positions
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ij,j->i", [(3, 4), (4,)]),
        ("i,j->ij", [(3,), (4,)]),
        ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ],
)
def test_einsum_grads_are_einsums(equation, shapes):
    q = _check_against_autograd("Einsum", [r(*shapes[0]), r(*shapes[1], seed=1)], {"equation": equation})
    _no_vjp(q, "Einsum")


def test_einsum_summing_a_label_of_one_operand_keeps_the_generic_rule():
    # i appears in the first operand only: its grad is a broadcast, not an einsum of the two
    q = _check_against_autograd("Einsum", [r(3, 4), r(4, 5, seed=1)], {"equation": "ij,jk->k"})
    assert any(op.type == "Vjp" and op.attrs["op"] == "Einsum" for op in q.ops)


@pytest.mark.parametrize(
    "op_type,attrs", [("HardSwish", {}), ("HardSigmoid", {}), ("HardSigmoid", {"alpha": 1 / 6})]
)
def test_hard_activations_have_their_own_grads(op_type, attrs):
    x = r(5, 7) * 4
    x[0, :3] = torch.tensor([-3.0, 3.0, 0.0], dtype=torch.float64)  # on the kinks
    q = _check_against_autograd(op_type, [x], attrs)
    _no_vjp(q, op_type)


@pytest.mark.parametrize(
    "pads,axes", [([1, 0, 2, 3], None), ([0, -1, 0, 2], None), ([2, 1], [1]), ([1, 1], [-2])], ids=str
)
def test_constant_pad_takes_its_pads_off_the_grad(pads, axes):
    fill = torch.tensor(0.5, dtype=torch.float64)
    extra = [torch.tensor(pads), fill] + ([torch.tensor(axes)] if axes else [])
    consts = set(range(1, 1 + len(extra)))
    q = _check_against_autograd("Pad", [r(4, 5), *extra], {}, params=[0], consts=consts)
    _no_vjp(q, "Pad")


@pytest.mark.parametrize(
    "bounds",
    [
        ([1], [5], [1], [2]),  # x[:, 1:5:2]
        ([0, 1], [2**62, -1], [0, 1], [2, 3]),  # two axes, an end past the dim, a negative end
        ([3], [4], [0], [5]),  # one row
    ],
    ids=str,
)
def test_a_strided_slice_writes_its_grad_back_at_the_strides(bounds):
    starts, ends, axes, steps = (torch.tensor(b) for b in bounds)
    inputs = [r(5, 6), starts, ends, axes, steps]
    q = _check_against_autograd("Slice", inputs, {}, params=[0], consts={1, 2, 3, 4})
    assert [op.type for op in q.ops if op.role == "backward"].count("SliceGrad") == 1
    _no_vjp(q, "Slice")


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},  # torch's output may be narrowed
        {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]},  # asymmetric: the autograd path
        {"kernel_shape": [3], "strides": [2]},  # 1-D: the autograd path
    ],
    ids=str,
)
def test_average_pool_has_its_own_grad(attrs):
    x = r(2, 3, 7, 7) if len(attrs["kernel_shape"]) == 2 else r(2, 3, 9)
    q = _check_against_autograd("AveragePool", [x], attrs)
    _no_vjp(q, "AveragePool")


@pytest.mark.parametrize(
    "shape,indices,batch_dims",
    [
        ((5, 4), [[0], [3], [0], [-1]], 0),  # rows, one repeated (summed), one negative
        ((4, 3, 2), [[1, 2], [0, 0], [1, 2]], 0),
        ((2, 3, 4), [[[1], [2]], [[0], [0]]], 1),
    ],
    ids=str,
)
def test_gather_nd_sums_its_grad_into_the_gathered_places(shape, indices, batch_dims):
    inputs = [r(*shape), torch.tensor(indices)]
    q = _check_against_autograd("GatherND", inputs, {"batch_dims": batch_dims}, params=[0], consts={1})
    _no_vjp(q, "GatherND")

"""The import-time passes: fold_constants, dead_code, fuse (each pure Program -> Program)."""

from __future__ import annotations

import numpy as np
import torch

import metaopt
from metaopt.ir import Op, Program, Var
from metaopt.passes.dead_code import dead_code
from metaopt.passes.fold_constants import fold_constants
from metaopt.passes.fuse import fuse


def _base(shape=("batch", 4, 8)) -> Program:
    p = Program("t")
    p.add_var(Var("x", "float32", shape, kind="input"))
    p.inputs = ["x"]
    return p


def test_fold_shape_chain_and_dynamic_reshape():
    p = _base()
    p.add_var(Var("s", "int64", (3,)))
    p.add_var(Var("i", "int64", (1,), kind="constant"), torch.tensor([2]))
    p.add_var(Var("last", "int64", (1,)))
    p.add_var(Var("m1", "int64", (1,), kind="constant"), torch.tensor([-1]))
    p.add_var(Var("target", "int64", (2,)))
    p.add_var(Var("y", "float32", ("4*batch", 8)))
    p.ops = [
        Op("Shape", ["x"], ["s"]),
        Op("Gather", ["s", "i"], ["last"], {"axis": 0}),  # the static last dim: folds
        Op("Concat", ["m1", "last"], ["target"], {"axis": 0}),
        Op("Reshape", ["x", "target"], ["y"]),
    ]
    p.outputs = ["y"]
    before = str(p)
    q = dead_code(fold_constants(p))
    assert str(p) == before  # pure: the input program is untouched
    assert [op.type for op in q.ops] == ["Reshape"]
    assert q.values[q.ops[0].inputs[1]].tolist() == [-1, 8]
    x = np.random.rand(3, 4, 8).astype(np.float32)
    (y,) = metaopt.Executor().run(q, feed={"x": x}, fetch_list=["y"])
    np.testing.assert_array_equal(y, x.reshape(12, 8))


def test_dead_code_keeps_random_ops_and_outputs():
    p = _base()
    p.add_var(Var("r", "float32", (), kind="constant"), torch.tensor(0.5))
    p.add_var(Var("t", "bool", (), kind="constant"), torch.tensor(True))
    for n in ("a", "d", "y"):
        p.add_var(Var(n, "float32", ("batch", 4, 8)))
    p.ops = [
        Op("Relu", ["x"], ["a"]),  # unused: removed
        Op("Dropout", ["x", "r", "t"], ["d"]),  # unused but random: kept (it moves the RNG)
        Op("Neg", ["x"], ["y"]),
    ]
    p.outputs = ["y"]
    q = dead_code(p)
    assert [op.type for op in q.ops] == ["Dropout", "Neg"]
    assert "a" not in q.vars


def test_fuse_folds_linear_of_params_with_and_without_bias():
    p = _base()
    p.add_var(Var("W", "float32", (16, 8), kind="param", trainable=True), torch.randn(16, 8))
    p.add_var(Var("b", "float32", (16,), kind="param", trainable=True), torch.randn(16))
    p.add_var(Var("V", "float32", (16, 8), kind="param", trainable=True), torch.randn(16, 8))
    for n, s in (
        ("wt", (8, 16)),
        ("xw", ("batch", 4, 16)),
        ("y", ("batch", 4, 16)),
        ("vt", (8, 16)),
        ("z", ("batch", 4, 16)),
        ("u", (16, 8)),
        ("ut", (8, 16)),
        ("v", ("batch", 4, 16)),
    ):
        p.add_var(Var(n, "float32", s))
    p.ops = [
        Op("Transpose", ["W"], ["wt"], {"perm": [1, 0]}),
        Op("MatMul", ["x", "wt"], ["xw"]),
        Op("Add", ["xw", "b"], ["y"], scope="fc"),
        Op("Transpose", ["V"], ["vt"], {"perm": [1, 0]}),
        Op("MatMul", ["x", "vt"], ["z"], scope="proj"),  # no bias: Linear(x, V)
        Op("Mul", ["V", "V"], ["u"]),
        Op("Transpose", ["u"], ["ut"], {"perm": [1, 0]}),
        Op("MatMul", ["x", "ut"], ["v"]),  # the transpose of an activation: left alone
    ]
    p.outputs = ["y", "z", "v"]
    q = fuse(p)
    assert [op.type for op in q.ops] == ["Linear", "Linear", "Mul", "Transpose", "MatMul"]
    assert q.ops[0].inputs == ["x", "W", "b"] and q.ops[0].outputs == ["y"] and q.ops[0].scope == "fc"
    assert q.ops[1].inputs == ["x", "V"] and q.ops[1].outputs == ["z"] and q.ops[1].scope == "proj"
    assert not {"wt", "xw", "vt"} & set(q.vars)
    x = np.random.rand(2, 4, 8).astype(np.float32)
    a = metaopt.Executor().run(p, feed={"x": x}, fetch_list=["y", "z", "v"])
    b = metaopt.Executor().run(q, feed={"x": x}, fetch_list=["y", "z", "v"])
    # F.linear vs matmul + add: the same products, the bias added inside the GEMM: float32 rounding.
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
    # without a bias both are one GEMM on the transposed weight: the same bits
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])


def test_fuse_nothing_to_do():
    p = _base()
    p.add_var(Var("y", "float32", ("batch", 4, 8)))
    p.ops = [Op("Relu", ["x"], ["y"])]
    p.outputs = ["y"]
    assert str(fuse(p)) == str(p)

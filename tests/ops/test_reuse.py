"""Ops written over an input that dies there (ops/reuse.py): chosen only where safe, same values,
and the memory estimate counts them as the executor does."""

from __future__ import annotations

import torch

import metaopt
from metaopt.ir import Op, Program, Var
from metaopt.ops.reuse import plan_reuse
from metaopt.passes.memory_estimate import estimate_memory

N = (64, 32)


def _program(ops: list[Op], extra: tuple[Var, ...] = ()) -> Program:
    """x (input) and w (param) -> h = MatMul(x, w): a fresh [64, 32] value the ops below use."""
    p = Program("reuse")
    p.add_var(Var("x", "float32", (64, 16), kind="input"))
    p.add_var(
        Var("w", "float32", (16, 32), kind="param"),
        torch.randn(16, 32, generator=torch.Generator().manual_seed(0)),
    )
    p.add_var(
        Var("b", "float32", (32,), kind="param"), torch.randn(32, generator=torch.Generator().manual_seed(1))
    )
    for name in ("h", "y", "z", "r", "t"):
        p.add_var(Var(name, "float32", N))
    for v in extra:
        p.add_var(v)
    p.inputs = [v.name for v in p.vars.values() if v.kind == "input"]
    p.ops = [Op("MatMul", ["x", "w"], ["h"]), *ops]
    return p


def _x() -> torch.Tensor:
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(2))


def test_relu_and_add_write_over_a_dying_input():
    # h dies at the Relu; y dies at the Add (its other input, b, broadcasts): both in place
    p = _program([Op("Relu", ["h"], ["y"]), Op("Add", ["y", "b"], ["z"])])
    assert plan_reuse(p, ["z"]) == {1: 0, 2: 0}


def test_add_writes_over_its_second_input_when_only_that_one_dies():
    p = _program([Op("Relu", ["h"], ["y"]), Op("Add", ["h", "y"], ["z"]), Op("Mul", ["h", "z"], ["r"])])
    # the Relu's h is read again (Add, Mul); the Add's h too, but y dies there: written over y;
    # at the Mul both die: the first one listed is taken
    assert plan_reuse(p, ["r"]) == {2: 1, 3: 0}


def test_never_over_what_is_read_later_fetched_fed_or_a_param():
    read_later = _program([Op("Relu", ["h"], ["y"]), Op("Add", ["y", "h"], ["z"])])
    assert 1 not in plan_reuse(read_later, ["z"])  # the Add reads h after the Relu
    fetched = _program([Op("Relu", ["h"], ["y"])])
    assert plan_reuse(fetched, ["y", "h"]) == {}
    fed = _program([Op("Relu", ["x"], ["x1"])], (Var("x1", "float32", (64, 16)),))
    assert plan_reuse(fed, ["x1"]) == {}  # the caller's tensor
    param = _program([Op("Relu", ["b"], ["b1"])], (Var("b1", "float32", (32,)),))
    assert plan_reuse(param, ["b1"]) == {}


def test_never_over_a_view_or_into_a_broadcast_or_another_dtype():
    # a Transpose's output is a view of h: not a storage of its own to write over
    view = _program(
        [Op("Transpose", ["h"], ["t2"], {"perm": [1, 0]}), Op("Relu", ["t2"], ["y2"])],
        (Var("t2", "float32", (32, 64)), Var("y2", "float32", (32, 64))),
    )
    assert plan_reuse(view, ["y2"]) == {}
    # b + h: b is [32] (a param anyway), h is [64, 32]: only h has the output's shape
    assert plan_reuse(_program([Op("Add", ["b", "h"], ["z"])]), ["z"]) == {1: 1}
    cast = _program(
        [Op("Cast", ["h"], ["h64"], {"to": 11}), Op("Add", ["h64", "d"], ["z64"])],
        (Var("h64", "float64", N), Var("d", "float32", N, kind="input"), Var("z64", "float64", N)),
    )
    assert 2 not in plan_reuse(cast, ["z64"])  # mixed dtypes: no in-place promotion


def test_same_values_and_the_estimate_matches_the_executor():
    ops = [Op("Relu", ["h"], ["y"]), Op("Add", ["y", "b"], ["z"]), Op("Mul", ["z", "z"], ["r"])]
    p = _program(ops)
    exe = metaopt.Executor("cpu")
    (r,) = exe.run(p, feed={"x": _x()}, fetch_list=["r"], return_numpy=False)
    w, b = p.values["w"], p.values["b"]
    z = torch.relu(_x() @ w) + b
    assert torch.equal(r, z * z)  # bit for bit: the same ATen loops, written elsewhere
    plan = next(iter(exe._plans.values()))
    assert plan.reused == {1: 0, 2: 0, 3: 0}
    assert "written over input 0" in plan.source
    measured = exe.memory_stats()["peak_bytes"]
    assert estimate_memory(p, dims={}, fetches=("r",)).peak_bytes == measured
    # one [64, 32] float32 value alive at a time besides x, w, b: h, then y, z, r on its storage
    assert measured == (64 * 16 + 16 * 32 + 32) * 4 + 64 * 32 * 4


def test_never_over_a_constant_ops_value():
    # Constant's kernel hands back its attribute's tensor (on the CPU the same storage every
    # run): an Add written over it would change the constant for the next run
    p = _program(
        [Op("Constant", [], ["c"], {"value": torch.ones(N)}), Op("Add", ["c", "h"], ["z"])],
        (Var("c", "float32", N),),
    )
    assert plan_reuse(p, ["z"]) == {2: 1}  # over h, never over c
    exe = metaopt.Executor("cpu")
    first = exe.run(p, feed={"x": _x()}, fetch_list=["z"], return_numpy=False)[0].clone()
    again = exe.run(p, feed={"x": _x()}, fetch_list=["z"], return_numpy=False)[0]
    assert torch.equal(first, again)


def test_never_over_an_input_another_input_views():
    # sq + sq^T: writing sq while reading its transposed view would be a partial overlap
    # (torch refuses it); sq + sq (the same var twice) is an exact one and allowed
    p = _program(
        [
            Op("Transpose", ["w"], ["wt"], {"perm": [1, 0]}),
            Op("MatMul", ["wt", "w"], ["sq"]),
            Op("Transpose", ["sq"], ["sqt"], {"perm": [1, 0]}),
            Op("Add", ["sq", "sqt"], ["s2"]),
            Op("Add", ["s2", "s2"], ["s4"]),
        ],
        tuple(
            Var(n, "float32", s)
            for n, s in (
                ("wt", (32, 16)),
                ("sq", (32, 32)),
                ("sqt", (32, 32)),
                ("s2", (32, 32)),
                ("s4", (32, 32)),
            )
        ),
    )
    assert plan_reuse(p, ["s4"]) == {5: 0}
    (s4,) = metaopt.Executor("cpu").run(p, feed={"x": _x()}, fetch_list=["s4"], return_numpy=False)
    sq = p.values["w"].T @ p.values["w"]
    assert torch.equal(s4, (sq + sq.T) + (sq + sq.T))

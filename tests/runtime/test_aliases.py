"""Which output may share storage with which input comes from the op's row, exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import metaopt
from metaopt.ir import Op, Program, Var
from metaopt.ops import registry
from metaopt.runtime.plan import CHECK_ALIASES, check_inplace


def _vjp_program() -> Program:
    # ViT's refusal: a Vjp's grad was linked to its forward inputs (the param), so an in-place
    # update of the param looked like it clobbered the grad. The grad may be dy, never w or x.
    p = Program("vjp")
    p.add_var(Var("w", "float32", (3,), kind="param"), torch.ones(3))
    p.add_var(Var("x", "float32", (3,), kind="input"))
    p.add_var(Var("y", "float32", (3,)))
    p.add_var(Var("dy", "float32", (3,), kind="input"))
    p.add_var(Var("dw", "float32", (3,)))
    p.ops = [
        Op("Add", ["w", "x"], ["y"]),
        Op(
            "Vjp", ["w", "x", "dy"], ["dw"], {"op": "Add", "n_in": 2, "wrt": [0], "n_out": 1}, role="backward"
        ),
    ]
    return p


def test_vjp_outputs_alias_only_output_grads():
    p = _vjp_program()
    vjp = p.ops[1]
    assert registry.alias_pairs(vjp) == [(0, 2)]  # dw may be dy; never w or x
    aliases, _ = check_inplace(p, set())
    assert aliases.find("dw") == aliases.find("dy")
    assert aliases.find("dw") != aliases.find("w")


def test_row_pairs_are_exact():
    def op(t, n_in, n_out, **attrs):
        return Op(t, [f"i{j}" for j in range(n_in)], [f"o{k}" for k in range(n_out)], attrs)

    assert registry.alias_pairs(op("Split", 2, 3)) == [(0, 0), (1, 0), (2, 0)]
    assert registry.alias_pairs(op("MatMul", 2, 1)) == []
    assert registry.alias_pairs(op("ReduceSum", 2, 1)) == []
    assert registry.alias_pairs(op("ReduceSum", 2, 1, noop_with_empty_axes=1)) == [(0, 0)]
    assert registry.alias_pairs(op("Sum", 1, 1)) == [(0, 0)]
    assert registry.alias_pairs(op("Sum", 2, 1)) == []
    assert registry.alias_pairs(op("Dropout", 3, 2)) == [(0, 0)]
    replay = Op("RngReplay", ["state", "x", "r", "t"], ["y", "m"], {"op": "Dropout", "n_out": 2})
    assert registry.alias_pairs(replay) == [(0, 1)]
    assert registry.alias_pairs(Op("NoSuchOp", ["a"], ["b"])) is None  # unknown: anything may alias


def test_check_mode_catches_an_undeclared_alias(monkeypatch):
    # Pretend Transpose's row forgot that its output is a view of its input.
    row = registry.get("Transpose")
    monkeypatch.setitem(registry._TABLE, "Transpose", dataclasses.replace(row, aliases=()))
    p = Program("t")
    p.add_var(Var("x", "float32", (2, 3), kind="input"))
    p.add_var(Var("y", "float32", (3, 2)))
    p.inputs, p.outputs = ["x"], ["y"]
    p.ops = [Op("Transpose", ["x"], ["y"], {"perm": [1, 0]})]
    feed = {"x": torch.randn(2, 3)}
    metaopt.Executor().run(p, feed=feed, fetch_list=["y"])  # the check is off by default
    monkeypatch.setenv(CHECK_ALIASES, "1")
    with pytest.raises(
        AssertionError, match=r"Transpose's output 0 shares storage with its input 0.*y = Transpose"
    ):
        metaopt.Executor().run(p, feed=feed, fetch_list=["y"])

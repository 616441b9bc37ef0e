"""Program.clone copies what passes edit and shares what is read-only (issue 17 item 7).

Passes are pure Program -> Program functions: each clones its input and edits the clone's ops
in place (``op.inputs[j] = ...``, ``op.outputs.append``, ``op.attrs.update``, ``op.role = ...``).
A clone therefore has its own ops, lists and attr dicts; tensors (initial values, tensor
attrs) are shared, read-only. No timed asserts here: benchmarks/load_100k.py measures.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import exported

import metaopt
from metaopt import fleet
from metaopt.ir import Op, Program, Split, Var
from metaopt.ir.program import _copy_op, _copy_var


def _op() -> Op:
    """An op with every field set to something other than its default."""
    return Op(
        "Conv",
        ["x", "w", ""],
        ["y", ""],
        {"pads": [1, 1], "nested": [[1, 2], [3]], "t": torch.ones(2), "s": "same"},
        role="backward",
        stage=3,
        scope="encoder.layer.0",
        origin="x",
    )


def _chain(n: int) -> Program:
    """x -> Relu -> Relu ... (n ops), every op with a list attr to edit."""
    p = Program("chain")
    p.add_var(Var("x", "float32", ("batch", 4), kind="input"))
    prev = "x"
    for i in range(n):
        p.add_var(Var(f"h{i}", "float32", ("batch", 4)))
        p.ops.append(Op("Relu", [prev], [f"h{i}"], {"tag": [i]}))
        prev = f"h{i}"
    p.inputs, p.outputs = ["x"], [prev]
    return p


def _snapshot(p: Program) -> list[tuple]:
    """Every field of every op and var, containers copied, tensors as lists."""

    def plain(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", x.tolist())
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}  # attrs
        if isinstance(x, list):
            return [plain(v) for v in x]
        return x

    ops = [tuple(plain(getattr(op, f.name)) for f in dataclasses.fields(Op)) for op in p.ops]
    fields = [f.name for f in dataclasses.fields(Var) if f.name != "program"]
    var_rows = [tuple(getattr(v, f) for f in fields) for v in p.vars.values()]
    return [str(p), ops, var_rows, list(p.inputs), list(p.outputs), dict(p.updates)]


def _containers(p: Program) -> set[int]:
    return {id(c) for op in p.ops for c in (op, op.inputs, op.outputs, op.attrs)} | {
        id(v) for v in p.vars.values()
    }


def test_every_op_field_is_copied():
    op = _op()
    new = _copy_op(op)
    assert type(new) is Op
    # A field added to Op without a line in _copy_op fails here (it would read the default).
    assert set(vars(new)) == {f.name for f in dataclasses.fields(Op)}
    for f in dataclasses.fields(Op):
        a, b = getattr(new, f.name), getattr(op, f.name)
        assert a is b or a == b, f.name
    assert new.inputs == op.inputs and new.inputs is not op.inputs
    assert new.outputs == op.outputs and new.outputs is not op.outputs
    assert new.attrs is not op.attrs and new.attrs.keys() == op.attrs.keys()
    assert new.attrs["nested"] == [[1, 2], [3]] and new.attrs["nested"][0] is not op.attrs["nested"][0]
    assert new.attrs["t"] is op.attrs["t"]  # read-only: shared, not copied


def test_every_var_field_is_copied():
    p, q = Program("p"), Program("q")
    v = p.add_var(Var("w", "bfloat16", (4, 6), kind="param", trainable=True, split=Split(1, 2, (12,))))
    new = _copy_var(v, q)
    assert type(new) is Var and new is not v and new.program is q and v.program is p
    assert set(vars(new)) == {f.name for f in dataclasses.fields(Var)}
    for f in dataclasses.fields(Var):
        if f.name != "program":
            assert getattr(new, f.name) == getattr(v, f.name), f.name


def test_edits_passes_make_to_a_clone_leave_the_original():
    p = Program("p")
    for name in ("x", "w", "y", "z"):
        p.add_var(Var(name, "float32", (2,)))
    p.ops = [_op(), Op("Relu", ["y"], ["z"])]
    before = _snapshot(p)
    q = p.clone()
    op = q.ops[0]
    op.inputs[0] = "renamed"  # amp, fuse_linear_cross_entropy
    op.inputs.append("extra")
    op.outputs[1] = "made"  # backward
    op.outputs.append("")  # backward
    op.attrs.update({"pads": [0, 0], "new": 1})  # fold_constants
    op.attrs["nested"][0].append(9)
    del op.attrs["s"]
    op.role, op.stage, op.scope, op.origin = "recompute", 0, "elsewhere", "z"
    q.ops[1].inputs = ["x"]  # tie, offload, recompute (a new list)
    q.vars["w"].kind, q.vars["w"].shape, q.vars["w"].trainable = "param", (9,), True
    del q.ops[1]
    assert _snapshot(p) == before


def test_clone_shares_tensors_and_no_containers():
    p = Program("p")
    t = torch.arange(3.0)
    p.add_var(Var("c", "float32", (3,), kind="constant"), t)
    p.add_var(Var("y", "float32", (3,)))
    p.ops = [Op("Constant", [], ["y"], {"value": t})]
    q = p.clone()
    assert q.values["c"] is t and q.ops[0].attrs["value"] is t
    assert not _containers(p) & _containers(q)


def test_clone_of_a_large_program_is_independent():
    # Past COMPILE_AT_ONCE_OPS (runtime/plan.py): the size the fast clone is for.
    p = _chain(6000)
    before = _snapshot(p)
    q = p.clone()
    for op in q.ops:
        op.inputs[0] += "!"
        op.attrs["tag"].append(-1)
        op.role = "backward"
    assert _snapshot(p) == before
    assert not _containers(p) & _containers(q)
    assert all(v.program is q for v in q.vars.values()) and all(v.program is p for v in p.vars.values())


def _strategy(kind: str) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if kind == "recompute_offload":
        s.recompute = True
        s.recompute_configs = {"checkpoints": ["bert.encoder.layer.*"], "enable_offload": True}
    elif kind == "amp":
        s.amp = True
    elif kind == "gradient_merge":
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": 2, "avg": True}
    return s


@pytest.mark.parametrize("kind", ["plain", "recompute_offload", "amp", "gradient_merge"])
def test_training_rewrites_of_a_clone_leave_the_original(kind):
    """Every pass of the training driver edits the clone it was given, never its source."""
    _, _, program = exported("bert", dropout=0.1)
    before = _snapshot(program)
    main = program.clone()
    fleet.init(is_collective=True)
    opt = fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), _strategy(kind))
    opt.minimize(main.loss)
    assert _snapshot(program) == before
    assert not _containers(program) & _containers(main)

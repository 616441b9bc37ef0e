"""metaopt.ir.program: Var, Op, Program."""

from __future__ import annotations

import pytest
import torch

from metaopt.ir import Op, Program, Var, did_you_mean, dtype_name, torch_dtype
from metaopt.ir.program import PERSISTABLE_KINDS, ROLES, VAR_KINDS


def _mlp() -> Program:
    """x -> MatMul(w) -> Relu -> ReduceMean = loss, plus a backward and an Adam step."""
    p = Program("mlp")
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    w = torch.randn(4, 3)
    p.add_var(Var("w", "float32", (4, 3), "param", trainable=True), w)
    p.add_var(Var("frozen_w", "float32", (3,), "param", trainable=False), torch.zeros(3))
    p.add_var(Var("m", "float32", (4, 3), "opt_state"), torch.zeros(4, 3))
    p.add_var(Var("bn.running_mean", "float32", (3,), "buffer"), torch.zeros(3))
    p.add_var(Var("h", "float32", ("batch", 3)))
    p.add_var(Var("a", "float32", ("batch", 3)))
    p.add_var(Var("loss", "float32", ()))
    p.add_var(Var("w@GRAD", "float32", (4, 3), "grad"))
    p.add_var(Var("w@NEW", "float32", (4, 3)))
    p.inputs = ["x"]
    p.outputs = ["loss"]
    p.loss_name = "loss"
    p.ops = [
        Op("MatMul", ["x", "w"], ["h"], scope="fc1"),
        Op("Relu", ["h"], ["a"], scope="act"),
        Op("ReduceMean", ["a"], ["loss"], {"keepdims": 0}, role="loss"),
        Op("MatMulGrad", ["x", "a", "loss"], ["w@GRAD"], role="backward", origin="w"),
        Op("Adam", ["w", "w@GRAD", "m", ""], ["w@NEW"], {"lr": 0.001}, role="optimize"),
    ]
    p.modules = {"fc1": ["h"], "act": ["a"]}
    p.updates = {"w": "w@NEW"}
    return p


# --- kinds and roles ---------------------------------------------------------------


def test_var_kinds_and_persistable():
    assert set(PERSISTABLE_KINDS) <= set(VAR_KINDS)
    for kind in VAR_KINDS:
        v = Var("v", "float32", (1,), kind)
        assert v.persistable == (kind in {"param", "buffer", "opt_state", "constant"})


def test_var_unknown_kind_did_you_mean():
    with pytest.raises(ValueError) as e:
        Var("fc1.weight", "float32", (2,), "parm")
    msg = str(e.value)
    assert "'fc1.weight'" in msg
    assert "'parm'" in msg
    assert "did you mean 'param'" in msg


def test_var_unknown_kind_without_close_match_has_no_suggestion():
    with pytest.raises(ValueError) as e:
        Var("v", "float32", (2,), "zzzzzz")
    assert "did you mean" not in str(e.value)


def test_var_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'float31'"):
        Var("v", "float31", (2,))


def test_op_unknown_role_did_you_mean():
    with pytest.raises(ValueError) as e:
        Op("Relu", ["x"], ["y"], role="backwards")
    msg = str(e.value)
    assert "Relu" in msg and "'backwards'" in msg
    assert "did you mean 'backward'" in msg


def test_op_role_lr_sched_did_you_mean():
    with pytest.raises(ValueError, match=r"did you mean 'lr-sched'"):
        Op("Mul", [], [], role="lr_sched")


@pytest.mark.parametrize("role", ROLES)
def test_op_every_role_accepted(role):
    assert Op("Identity", ["x"], ["y"], role=role).role == role


def test_op_defaults():
    op = Op("Relu", ["x"], ["y"])
    assert (op.attrs, op.role, op.stage, op.scope, op.origin) == ({}, "forward", None, "", None)
    # default attrs are not shared between ops
    op.attrs["k"] = 1
    assert Op("Relu", ["x"], ["y"]).attrs == {}


def test_did_you_mean_helper():
    assert did_you_mean("forwrd", ROLES) == " (did you mean 'forward'?)"
    assert did_you_mean("qqq", ROLES) == ""


def test_dtype_name_round_trip():
    for name in ("float32", "float16", "bfloat16", "int64", "bool", "uint8"):
        assert dtype_name(torch_dtype(name)) == name
    assert torch_dtype("bfloat16") is torch.bfloat16


# --- lookup ---------------------------------------------------------------------


def test_var_lookup_and_did_you_mean():
    p = _mlp()
    assert p.var("w") is p.vars["w"]
    with pytest.raises(KeyError) as e:
        p.var("bn.running_maen")
    msg = str(e.value)
    assert "'mlp'" in msg and "'bn.running_maen'" in msg
    assert "did you mean 'bn.running_mean'" in msg


def test_loss_property():
    p = _mlp()
    assert p.loss is p.vars["loss"]
    p.loss_name = None
    with pytest.raises(ValueError, match="has no loss"):
        _ = p.loss


def test_params_and_persistables():
    p = _mlp()
    assert [v.name for v in p.params()] == ["w"]
    assert [v.name for v in p.params(trainable_only=False)] == ["w", "frozen_w"]
    assert [v.name for v in p.persistables()] == ["w", "frozen_w", "m", "bn.running_mean"]


def test_add_var_duplicate_and_value():
    p = Program("q")
    t = torch.ones(2)
    v = p.add_var(Var("c", "float32", (2,), "constant"), t)
    assert p.vars["c"] is v
    assert p.values["c"] is t
    p.add_var(Var("h", "float32", (2,)))
    assert "h" not in p.values
    with pytest.raises(ValueError, match="already has a var 'c'"):
        p.add_var(Var("c", "float32", (2,)))


def test_producers_and_consumers():
    p = _mlp()
    prod = p.producers()
    assert prod == {"h": 0, "a": 1, "loss": 2, "w@GRAD": 3, "w@NEW": 4}
    cons = p.consumers()
    assert cons["x"] == [0, 3]
    assert cons["a"] == [2, 3]
    assert cons["w"] == [0, 4]
    assert "" not in cons  # omitted optional input of Adam
    assert "w@NEW" not in cons


def test_producers_skip_omitted_outputs():
    p = Program()
    p.ops = [Op("Dropout", ["x"], ["y", ""]), Op("Split", ["y"], ["a", "b"])]
    assert p.producers() == {"y": 0, "a": 1, "b": 1}


def test_ops_with_role():
    p = _mlp()
    assert [op.type for op in p.ops_with_role("forward")] == ["MatMul", "Relu"]
    assert [op.type for op in p.ops_with_role("backward", "optimize")] == ["MatMulGrad", "Adam"]
    assert list(p.ops_with_role("comm")) == []


# --- nbytes ------------------------------------------------------------------------


def test_nbytes_static():
    assert Var("w", "float32", (4, 3)).nbytes() == 48
    assert Var("w", "bfloat16", (4, 3)).nbytes() == 24
    assert Var("w", "int64", (5,)).nbytes() == 40
    assert Var("b", "bool", (7,)).nbytes() == 7
    assert Var("s", "float64", ()).nbytes() == 8  # scalar


def test_nbytes_symbolic_bound_and_unbound():
    v = Var("x", "float16", ("batch", 16))
    assert v.nbytes() is None
    assert v.nbytes({}) is None
    assert v.nbytes({"seq": 3}) is None
    assert v.nbytes({"batch": 8}) == 8 * 16 * 2
    assert v.nbytes({"batch": 8, "seq": 3}) == 8 * 16 * 2


def test_nbytes_expression_dim():
    v = Var("x", "float32", ("4*batch", 2))
    assert v.nbytes() is None
    assert v.nbytes({"batch": 3}) == 4 * 3 * 2 * 4
    assert Var("y", "float32", ("batch - 1",)).nbytes({"batch": 5}) == 16
    assert Var("y", "float32", ("batch - 1",)).nbytes({"seq": 5}) is None


def test_nbytes_unknown_shape():
    assert Var("x", "float32", None).nbytes() is None
    assert Var("x", "float32", None).nbytes({"batch": 2}) is None


def test_nbytes_zero_dim():
    assert Var("x", "float32", (0, 5)).nbytes() == 0


# --- clone / replace_with -----------------------------------------------------------


def test_clone_equal_structure():
    p = _mlp()
    q = p.clone()
    assert str(q) == str(p)
    assert q.name == p.name and q.loss_name == p.loss_name
    assert q.inputs == p.inputs and q.outputs == p.outputs
    assert q.modules == p.modules and q.updates == p.updates
    assert list(q.vars) == list(p.vars)


def test_clone_shares_value_tensors():
    p = _mlp()
    q = p.clone()
    assert q.values.keys() == p.values.keys()
    for k in p.values:
        assert q.values[k] is p.values[k]
    # ...but the dict itself is not shared
    q.values["extra"] = torch.zeros(1)
    assert "extra" not in p.values
    del q.values["w"]
    assert "w" in p.values


def test_clone_is_deep_for_ops():
    p = _mlp()
    before = str(p)
    q = p.clone()
    q.ops[0].inputs.append("zzz")
    q.ops[0].outputs[0] = "renamed"
    q.ops[4].attrs["lr"] = 1.0
    q.ops[1].role = "recompute"
    q.ops[1].scope = "elsewhere"
    q.ops.append(Op("Identity", ["a"], ["b"]))
    del q.ops[2]
    assert str(p) == before
    assert p.ops[0].inputs == ["x", "w"]
    assert p.ops[4].attrs == {"lr": 0.001}
    assert len(p.ops) == 5


def test_clone_deep_for_tensor_attrs():
    p = Program()
    t = torch.tensor([1.0, 2.0])
    p.ops = [Op("Constant", [], ["c"], {"value": t, "dims": [1, 2]})]
    q = p.clone()
    q.ops[0].attrs["dims"].append(3)
    assert p.ops[0].attrs["dims"] == [1, 2]
    assert torch.equal(q.ops[0].attrs["value"], t)


def test_clone_is_deep_for_vars():
    p = _mlp()
    q = p.clone()
    assert q.vars["h"] is not p.vars["h"]
    q.vars["h"].kind = "grad"
    q.vars["h"].shape = (1, 1)
    q.vars["w"].trainable = False
    q.add_var(Var("new", "float32", (1,)))
    del q.vars["a"]
    assert p.vars["h"].kind == "activation" and p.vars["h"].shape == ("batch", 3)
    assert p.vars["w"].trainable is True
    assert "new" not in p.vars and "a" in p.vars


def test_clone_is_deep_for_lists_and_maps():
    p = _mlp()
    q = p.clone()
    q.inputs.append("y")
    q.outputs.clear()
    q.modules["fc1"].append("a")
    q.modules["new"] = ["x"]
    q.updates["m"] = "m@NEW"
    del q.updates["w"]
    q.loss_name = None
    q.name = "other"
    assert p.inputs == ["x"] and p.outputs == ["loss"]
    assert p.modules == {"fc1": ["h"], "act": ["a"]}
    assert p.updates == {"w": "w@NEW"}
    assert p.loss_name == "loss" and p.name == "mlp"


def test_clone_of_clone_mutation_does_not_touch_clone():
    p = _mlp()
    q = p.clone()
    r = q.clone()
    r.ops[0].attrs["x"] = 1
    r.modules["act"].append("h")
    assert "x" not in q.ops[0].attrs and q.modules["act"] == ["a"]


def test_replace_with_bumps_version_and_takes_contents():
    p = _mlp()
    assert p.version == 0
    other = _mlp()
    other.name = "rewritten"
    other.ops = other.ops[:3]
    other.updates = {}
    p.replace_with(other)
    assert p.version == 1
    assert p.name == "rewritten"
    assert [op.type for op in p.ops] == ["MatMul", "Relu", "ReduceMean"]
    assert p.updates == {}
    p.replace_with(other)
    assert p.version == 2


def test_replace_with_keeps_version_monotonic_even_if_other_is_newer():
    p = Program()
    other = Program()
    other.version = 7
    p.replace_with(other)
    assert p.version == 1  # p's own counter, not other's


def test_replace_with_copies_structure():
    p = Program()
    other = _mlp()
    text = str(other)
    p.replace_with(other)
    p.ops[0].inputs.append("zzz")
    p.modules["fc1"].append("zzz")
    p.vars["h"].kind = "grad"
    assert str(other) == text
    # values are shared (read-only initial tensors)
    assert p.values["w"] is other.values["w"]


def test_repr():
    p = _mlp()
    assert repr(p) == "<Program 'mlp': 5 ops, 10 vars>"

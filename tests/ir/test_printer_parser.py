"""The golden text format: printer and parser are exact inverses."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from metaopt.ir import Op, ParseError, Program, Split, Var, parse_program, print_program
from metaopt.ir.printer import INLINE_VALUES, fmt_name, fmt_op, fmt_value
from metaopt.ir.program import ROLES, VAR_KINDS

# --- structural comparison -------------------------------------------------------


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and _bitwise_equal(a, b)
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def _var_key(v: Var):
    return (v.name, v.dtype, v.shape, v.kind, v.trainable)


def _op_fields(op: Op):
    return (op.type, op.inputs, op.outputs, op.role, op.stage, op.scope, op.origin)


def assert_same_program(p: Program, q: Program, inline_values: bool = True) -> None:
    assert q.name == p.name
    assert [_var_key(v) for v in q.vars.values()] == [_var_key(v) for v in p.vars.values()]
    for v in p.vars.values():  # shapes keep int vs str dims apart
        assert [type(d) for d in q.vars[v.name].shape or ()] == [type(d) for d in v.shape or ()]
    assert len(q.ops) == len(p.ops)
    for a, b in zip(p.ops, q.ops):
        assert _op_fields(b) == _op_fields(a), fmt_op(a)
        assert list(b.attrs) == list(a.attrs), fmt_op(a)
        for k in a.attrs:
            assert _same_value(a.attrs[k], b.attrs[k]), (fmt_op(a), k, a.attrs[k], b.attrs[k])
    assert q.inputs == p.inputs
    assert q.outputs == p.outputs
    assert q.loss_name == p.loss_name
    assert q.modules == p.modules
    assert list(q.modules) == list(p.modules)
    assert q.updates == p.updates
    assert list(q.updates) == list(p.updates)
    if inline_values:
        for name, t in p.values.items():
            v = p.vars[name]
            if v.kind == "constant" and t.numel() <= INLINE_VALUES:
                assert name in q.values, name
                assert _same_value(t, q.values[name]), (name, t, q.values[name])


def round_trip(p: Program) -> Program:
    text = print_program(p)
    q = parse_program(text)
    assert print_program(q) == text
    assert_same_program(p, q)
    return q


# --- the design's example --------------------------------------------------------

DESIGN_EXAMPLE = """\
program mlp
inputs: x, w1
outputs: a
vars:
  x: float32[batch,16] input
  w1: float32[16,32] input
  h: float32[batch,32]
  a: float32[batch,32]
  a@PINNED: float32[batch,32]
  a@FETCH: float32[batch,32]
  h@RECOMPUTE: float32[batch,32]
ops:
  h = MatMul(x, w1)                         # role=forward scope=fc1
  a = Relu(h)                               # role=forward scope=act
  a@PINNED = Memcpy(a, dst=pinned)          # role=offload origin=a
  a@FETCH = Memcpy(a@PINNED, dst=device)    # role=prefetch origin=a
  h@RECOMPUTE = MatMul(x, w1)               # role=recompute origin=h
"""


def _squeeze_comment_gap(text: str) -> str:
    return re.sub(r" {2,}# ", "  # ", text)


def test_design_example_parses_and_prints_back():
    # DESIGN.md's snippet puts '#' one column left of the printer's layout; the parser
    # does not care about the gap, and the printed text is a fixed point of parse/print.
    p = parse_program(DESIGN_EXAMPLE)
    text = print_program(p)
    assert _squeeze_comment_gap(text) == _squeeze_comment_gap(DESIGN_EXAMPLE)
    assert print_program(parse_program(text)) == text
    assert p.name == "mlp"
    op = p.ops[2]
    assert (op.type, op.inputs, op.outputs, op.attrs, op.role, op.origin, op.scope) == (
        "Memcpy",
        ["a"],
        ["a@PINNED"],
        {"dst": "pinned"},
        "offload",
        "a",
        "",
    )
    assert p.ops[0].scope == "fc1" and p.ops[0].origin is None
    assert p.vars["x"].shape == ("batch", 16) and p.vars["x"].kind == "input"
    assert p.vars["h"].kind == "activation"


def test_str_of_program_is_print_program():
    p = parse_program(DESIGN_EXAMPLE)
    assert str(p) == print_program(p)


# --- fmt helpers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("fc1.weight", "fc1.weight"),
        ("a@GRAD", "a@GRAD"),
        ("bn/running_mean", "bn/running_mean"),
        ("0", "0"),
        ("", "~"),
        ("~", '"~"'),
        ("a b", '"a b"'),
        ("a,b", '"a,b"'),
        ('q"t', '"q\\"t"'),
    ],
)
def test_fmt_name(name, want):
    assert fmt_name(name) == want


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (3, "3"),
        (-2, "-2"),
        (0.1, "0.1"),
        (1e-05, "1e-05"),
        (float("-inf"), "-inf"),
        (float("inf"), "inf"),
        (float("nan"), "nan"),
        (True, "True"),
        (False, "False"),
        (None, "None"),
        ("pinned", "pinned"),
        ("tensor", '"tensor"'),
        ("True", '"True"'),
        ("a b", '"a b"'),
        ([1, 2], "[1, 2]"),
        ([], "[]"),
        ([[1], ["x"]], "[[1], [x]]"),
    ],
)
def test_fmt_value(value, want):
    assert fmt_value(value) == want


def test_fmt_value_rejects_unknown_types():
    with pytest.raises(TypeError, match="cannot print attribute value of type dict"):
        fmt_value({"a": 1})


def test_a_small_constant_on_meta_prints_by_type_where_one_with_data_prints_its_values():
    """A meta export's constant may have no data: the program still prints (it raised before)."""
    from metaopt.ir.printer import fmt_var

    var = Var("c", "float32", [2], kind="constant")
    assert fmt_var(var, torch.zeros(2, device="meta")) == "c: float32[2] constant"
    assert fmt_var(var, torch.zeros(2)) == "c: float32[2] constant = [0.0, 0.0]"


def test_fmt_op_layout():
    op = Op("Relu", ["h"], ["a"], role="forward", scope="act")
    line = fmt_op(op)
    assert line.index("#") == 43  # comment column (0-based 43 = column 44)
    assert line == "a = Relu(h)".ljust(41) + "  # role=forward scope=act"
    assert fmt_op(Op("Send", ["x"], [], {"peer": 1}, role="comm", stage=0)).startswith("Send(x, peer=1) ")
    assert "stage=0" in fmt_op(Op("Send", ["x"], [], role="comm", stage=0))


# --- round trips ------------------------------------------------------------------------


def _base(name: str = "main") -> Program:
    p = Program(name)
    p.add_var(Var("x", "float32", ("batch", 4), "input"))
    p.inputs = ["x"]
    return p


@pytest.mark.parametrize(
    "name",
    [
        "a b",
        "a,b",
        'say "hi"',
        "ünï©ødé",
        "日本",
        "~",
        "0",
        "3.weight",
        "1.5",
        "-3",
        ".5",
        "1e5",
        "inf",
        "-inf",
        "nan",
        "True",
        "tensor",
        "frozen",
        "x:y",
        "a=b",
        "(p)",
        "[q]",
        "a\tb",
        "back\\slash",
        "new\nline",
        "<-",
        "?",
        "#",
        "a # b",
        "layers.0.mlp.fc1.weight@GRAD",
    ],
)
def test_round_trip_odd_names_everywhere(name):
    """The same odd name as program name, var, input, output, loss, op I/O, scope, origin, module."""
    p = Program(name)
    p.add_var(Var(name, "float32", (), "input"))
    p.add_var(Var("y", "float32", ()))
    p.add_var(Var("z", "float32", ()))
    p.inputs = [name]
    p.outputs = ["z", name]
    p.loss_name = "z"
    p.ops = [
        Op("Relu", [name], ["y"], {"name": name}, scope=name, origin=name),
        Op("Neg", ["y"], ["z"], scope="s", origin=name),
    ]
    p.modules = {name: [name, "y"]}
    q = round_trip(p)
    assert q.ops[0].attrs["name"] == name


def test_round_trip_numeric_names_in_every_position():
    p = Program("0")
    p.add_var(Var("0", "float32", (2,), "input"))
    p.add_var(Var("3.weight", "float32", (2,), "param", trainable=True), torch.ones(2))
    p.add_var(Var("1", "float32", (2,)))
    p.add_var(Var("2", "float32", (2,)))
    p.inputs = ["0"]
    p.outputs = ["2"]
    p.ops = [
        Op("Mul", ["0", "3.weight"], ["1"], scope="3", origin="0"),
        Op("Relu", ["1"], ["2"], scope="4.5", stage=0),
    ]
    p.modules = {"3": ["1"], "4.5": ["2"]}
    q = round_trip(p)
    assert q.ops[0].inputs == ["0", "3.weight"]
    assert q.vars["3.weight"].trainable


def test_round_trip_omitted_optional_inputs_and_outputs():
    p = _base()
    p.add_var(Var("y", "float32", ("batch", 4)))
    p.add_var(Var("mask", "bool", ("batch", 4)))
    p.add_var(Var("z", "float32", ("batch", 4)))
    p.ops = [
        Op("Dropout", ["x", "", ""], ["y", ""], {"seed": 0}),
        Op("Clip", ["y", "", "x"], ["z"]),
        Op("Dropout", ["y"], ["", "mask"]),
    ]
    q = round_trip(p)
    assert q.ops[0].inputs == ["x", "", ""]
    assert q.ops[0].outputs == ["y", ""]
    assert q.ops[1].inputs == ["y", "", "x"]
    assert q.ops[2].outputs == ["", "mask"]
    assert "y, ~ = Dropout(x, ~, ~, seed=0)" in print_program(p)


def test_round_trip_zero_output_and_zero_input_ops():
    p = _base()
    p.add_var(Var("r", "float32", ("batch", 4)))
    p.add_var(Var("c", "int64", (2,)))
    p.ops = [
        Op("Send", ["x"], [], {"peer": 1}, role="comm", stage=0),
        Op("Recv", [], ["r"], {"peer": 0}, role="comm", stage=1),
        Op("Constant", [], ["c"], {"value": torch.tensor([1, 2])}),
        Op("Barrier", [], [], role="comm"),
        Op("Print", ["r", "c"], [], {"msg": "a = b"}),
    ]
    q = round_trip(p)
    assert [(op.inputs, op.outputs) for op in q.ops] == [
        (["x"], []),
        ([], ["r"]),
        ([], ["c"]),
        ([], []),
        (["r", "c"], []),
    ]
    assert q.ops[4].attrs == {"msg": "a = b"}


def test_round_trip_multi_output_ops():
    p = _base()
    for n in ("a", "b", "c d", "0"):
        p.add_var(Var(n, "float32", ("batch", 1)))
    p.ops = [Op("Split", ["x"], ["a", "b", "c d", "0"], {"axis": 1, "split": [1, 1, 1, 1]})]
    q = round_trip(p)
    assert q.ops[0].outputs == ["a", "b", "c d", "0"]


ALL_ATTRS = {
    "i": 3,
    "neg": -7,
    "zero": 0,
    "big": 2**62,
    "f": 1.5,
    "small": 1e-05,
    "tenth": 0.1,
    "ninf": float("-inf"),
    "pinf": float("inf"),
    "nan": float("nan"),
    "negzero": -0.0,
    "huge": 1e300,
    "tiny": 5e-324,
    "whole": 2.0,
    "t": True,
    "fl": False,
    "none": None,
    "word": "pinned",
    "under": "_x1",
    "spaced": "hello world",
    "quoted": 'a "q" b',
    "empty_s": "",
    "r_tensor": "tensor",
    "r_true": "True",
    "r_false": "False",
    "r_none": "None",
    "r_inf": "inf",
    "r_nan": "nan",
    "numeric_s": "12",
    "float_s": "1.5",
    "tilde": "~",
    "uni": "héllo ✓",
    "newline": "a\nb",
    "infx": "inf_x",
    "ints": [1, -2, 3],
    "floats": [0.5, -1e-05, 2.0],
    "mixed": [1, 2.0, "a", None, True],
    "strs": ["a", "b c", "True", ""],
    "nested": [[1, 2], [3, [4, 5]], []],
    "empty": [],
    "inf_list": [float("inf"), float("-inf")],
    "f32": torch.tensor([[1.5, -2.25], [0.1, 3.0]], dtype=torch.float32),
    "f32_special": torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40], dtype=torch.float32),
    "i64": torch.tensor([1, -2, 2**40], dtype=torch.int64),
    "b": torch.tensor([True, False, True]),
    "bf16": torch.tensor([1.0, 0.1, -3.5, 1e30], dtype=torch.bfloat16),
    "f16": torch.tensor([0.1, 65504.0], dtype=torch.float16),
    "scalar_t": torch.tensor(2.5),
    "empty_t": torch.zeros(0, 3),
    "i32_t": torch.tensor([[7]], dtype=torch.int32),
}


def test_round_trip_every_attribute_kind():
    p = _base()
    p.add_var(Var("y", "float32", ("batch", 4)))
    p.ops = [Op("Custom", ["x"], ["y"], dict(ALL_ATTRS))]
    q = round_trip(p)
    got = q.ops[0].attrs
    assert math.isnan(got["nan"])
    assert got["ninf"] == float("-inf") and got["pinf"] == float("inf")
    assert type(got["i"]) is int and type(got["whole"]) is float and type(got["t"]) is bool
    assert got["small"] == 1e-05 and got["tenth"] == 0.1
    assert got["none"] is None
    for k in ("r_tensor", "r_true", "r_none", "r_inf", "r_nan", "numeric_s", "tilde"):
        assert got[k] == ALL_ATTRS[k] and isinstance(got[k], str), k
    assert got["bf16"].dtype == torch.bfloat16
    assert got["empty_t"].shape == (0, 3)
    assert got["scalar_t"].shape == ()


@pytest.mark.parametrize("key", sorted(ALL_ATTRS))
def test_round_trip_each_attribute_alone(key):
    p = _base()
    p.add_var(Var("y", "float32", ("batch", 4)))
    p.ops = [Op("Custom", ["x"], ["y"], {key: ALL_ATTRS[key]})]
    round_trip(p)


def test_round_trip_op_fields():
    p = _base()
    for n in ("a", "b", "c", "d"):
        p.add_var(Var(n, "float32", ("batch", 4)))
    p.ops = [
        Op("Relu", ["x"], ["a"], role="forward", stage=0, scope="layers.0.act"),
        Op("Memcpy", ["a"], ["b"], {"dst": "pinned"}, role="offload", origin="a"),
        Op("Memcpy", ["b"], ["c"], {"dst": "device"}, role="prefetch", stage=3, origin="a"),
        Op("Relu", ["x"], ["d"], role="recompute", stage=12, scope="a b", origin=""),
    ]
    q = round_trip(p)
    assert q.ops[0].stage == 0 and q.ops[0].scope == "layers.0.act" and q.ops[0].origin is None
    assert q.ops[2].stage == 3 and q.ops[2].origin == "a"
    assert q.ops[3].origin == "" and q.ops[3].scope == "a b"
    assert q.ops[1].stage is None and q.ops[1].scope == ""


@pytest.mark.parametrize("role", ROLES)
def test_round_trip_every_role(role):
    p = _base()
    p.add_var(Var("y", "float32", ("batch", 4)))
    p.ops = [Op("Relu", ["x"], ["y"], role=role)]
    assert round_trip(p).ops[0].role == role


def test_round_trip_shapes_and_kinds():
    p = Program("shapes")
    p.add_var(Var("x", "float32", ("batch", 16), "input"))
    p.add_var(Var("seq", "int64", ("batch", "seq"), "input"))
    p.add_var(Var("unknown", "float32", None))
    p.add_var(Var("scalar", "float32", ()))
    p.add_var(Var("w", "bfloat16", (16, 32), "param", trainable=True), torch.zeros(16, 32))
    p.add_var(Var("emb", "float16", (100, 8), "param", trainable=False), torch.zeros(100, 8))
    p.add_var(Var("bn.running_var", "float32", (32,), "buffer"), torch.ones(32))
    p.add_var(Var("w@GRAD", "bfloat16", (16, 32), "grad"))
    p.add_var(Var("w.moment1", "float32", (16, 32), "opt_state"), torch.zeros(16, 32))
    p.add_var(Var("zero_dim", "float32", (0,)))
    p.inputs = ["x", "seq"]
    q = round_trip(p)
    assert q.vars["unknown"].shape is None
    assert q.vars["scalar"].shape == ()
    assert q.vars["w"].trainable is True and q.vars["emb"].trainable is False
    assert q.vars["seq"].shape == ("batch", "seq")
    assert set(VAR_KINDS) - {"constant"} <= {v.kind for v in q.vars.values()}
    text = print_program(p)
    assert "  unknown: float32[?]\n" in text
    assert "  scalar: float32[]\n" in text
    assert "  emb: float16[100,8] param frozen\n" in text
    assert "  w: bfloat16[16,32] param\n" in text


def test_round_trip_split_vars_and_unsplit_ones_print_as_before():
    """Tensor parallel's Var.split: a worker's part of a larger tensor, after the kind."""
    p = Program("split")
    p.add_var(Var("w", "float32", (48, 32), "param", trainable=True, split=Split(0, 2, (32, 32, 32))))
    p.add_var(Var("e", "float32", (50, 8), "param", trainable=False, split=Split(0, 2, (100,))))
    p.add_var(Var("w@MOMENT1", "float32", (48, 32), "opt_state", split=Split(0, 2, (32, 32, 32))))
    p.add_var(Var("split", "float32", (4, 8), split=Split(1, 4, (32,))))  # a var named like the field
    p.add_var(Var("b", "float32", (32,), "param", trainable=True))
    q = round_trip(p)
    assert q.vars == p.vars
    assert q.vars["w"].full_shape == (96, 32) and q.vars["b"].full_shape == (32,)
    text = print_program(p)
    assert "  w: float32[48,32] param split(axis=0, parts=2, blocks=[32, 32, 32])\n" in text
    assert "  e: float32[50,8] param frozen split(axis=0, parts=2, blocks=[100])\n" in text
    assert "  split: float32[4,8] split(axis=1, parts=4, blocks=[32])\n" in text
    assert "  b: float32[32] param\n" in text


@pytest.mark.parametrize("dim", ["4*batch", "batch - 1", "(batch+1)"])
def test_round_trip_expression_dims(dim):
    p = _base()
    p.add_var(Var("y", "float32", (dim, 4)))
    p.ops = [Op("Reshape", ["x"], ["y"])]
    q = round_trip(p)
    assert q.vars["y"].shape == (dim, 4)


CONSTANTS = {
    "c_f32": torch.tensor([0.1, -0.0, 1e-40, 3.4e38, float("inf"), float("-inf")]),
    "c_nan": torch.tensor([float("nan"), 1.0]),
    "c_scalar": torch.tensor(0.1),
    "c_2d": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
    "c_i64": torch.tensor([-(2**62), 0, 2**62]),
    "c_i32": torch.tensor([[1], [-2]], dtype=torch.int32),
    "c_u8": torch.tensor([0, 255], dtype=torch.uint8),
    "c_bool": torch.tensor([True, False]),
    "c_bool_scalar": torch.tensor(True),
    "c_bf16": torch.tensor([0.1, -1.5, 3e38], dtype=torch.bfloat16),
    "c_f16": torch.tensor([0.1, 6e-8], dtype=torch.float16),
    "c_f64": torch.tensor([0.1, 1 / 3], dtype=torch.float64),
    "c_exact8": torch.arange(8, dtype=torch.float32) / 7,
    "c_empty": torch.zeros(0),
}


def test_round_trip_small_constants_inline_bitwise():
    p = Program("consts")
    for name, t in CONSTANTS.items():
        p.add_var(Var(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), "constant"), t)
    q = round_trip(p)
    for name, t in CONSTANTS.items():
        got = q.values[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert _bitwise_equal(got, t) or (name == "c_nan" and torch.isnan(got[0]) and got[1] == 1), name
    text = print_program(p)
    assert "  c_scalar: float32[] constant = 0.10000000149011612\n" in text
    assert "  c_bool: bool[2] constant = [True, False]\n" in text


def test_round_trip_empty_2d_constant_keeps_shape():
    p = Program()
    p.add_var(Var("c", "float32", (0, 3), "constant"), torch.zeros(0, 3))
    q = round_trip(p)
    assert q.values["c"].shape == (0, 3)


def test_large_constants_are_not_inlined():
    p = Program()
    big = torch.arange(INLINE_VALUES + 1, dtype=torch.float32)
    p.add_var(Var("big", "float32", (INLINE_VALUES + 1,), "constant"), big)
    p.add_var(Var("edge", "float32", (INLINE_VALUES,), "constant"), big[:INLINE_VALUES].clone())
    p.add_var(Var("small_param", "float32", (2,), "param", trainable=True), torch.ones(2))
    p.add_var(Var("no_value", "float32", (2,), "constant"))
    text = print_program(p)
    assert f"  big: float32[{INLINE_VALUES + 1}] constant\n" in text
    assert "  edge: float32[8] constant = [0.0, 1.0, " in text
    assert "  small_param: float32[2] param\n" in text  # only constants are inlined
    assert "  no_value: float32[2] constant\n" in text
    q = parse_program(text)
    assert print_program(q) == text
    assert "big" not in q.values and "small_param" not in q.values and "no_value" not in q.values
    assert torch.equal(q.values["edge"], big[:INLINE_VALUES])


def test_round_trip_modules_updates_loss():
    p = _base("trainer")
    p.add_var(Var("w", "float32", (4,), "param", trainable=True), torch.zeros(4))
    p.add_var(Var("bn.running_mean", "float32", (4,), "buffer"), torch.zeros(4))
    p.add_var(Var("bn/running_mean", "float32", (4,)))
    p.add_var(Var("w@NEW", "float32", (4,)))
    p.add_var(Var("loss", "float32", ()))
    p.outputs = ["loss"]
    p.loss_name = "loss"
    p.modules = {"": ["loss"], "bn": ["bn/running_mean"], "layers.0": [], "a b": ["w@NEW", "loss"]}
    p.updates = {"w": "w@NEW", "bn.running_mean": "bn/running_mean"}
    p.ops = [
        Op("BatchNormStats", ["x"], ["bn/running_mean"], scope="bn"),
        Op("ReduceMean", ["x"], ["loss"], {"keepdims": 0}, role="loss"),
        Op("Sgd", ["w", "bn/running_mean"], ["w@NEW"], {"lr": 0.1}, role="optimize"),
    ]
    q = round_trip(p)
    assert q.loss_name == "loss"
    assert q.updates == {"w": "w@NEW", "bn.running_mean": "bn/running_mean"}
    assert q.modules["layers.0"] == [] and q.modules[""] == ["loss"]
    text = print_program(p)
    assert "updates:\n  w <- w@NEW\n  bn.running_mean <- bn/running_mean\n" in text


def test_round_trip_empty_program():
    p = Program("empty")
    text = print_program(p)
    assert text == "program empty\ninputs: \noutputs: \nvars:\nops:\n"
    q = round_trip(p)
    assert q.loss_name is None and q.modules == {} and q.updates == {}


def test_parser_ignores_blank_lines():
    want = print_program(parse_program(DESIGN_EXAMPLE))
    text = want.replace("vars:\n", "\nvars:\n\n").replace("ops:\n", "ops:\n   \n")
    assert print_program(parse_program(text)) == want


@pytest.mark.parametrize("where", ["name", "attr"])
def test_round_trip_comment_marker_inside_quotes(where):
    p = _base()
    y = "a  # b" if where == "name" else "y"
    p.add_var(Var(y, "float32", ("batch", 4)))
    attrs = {"s": "u  # role=backward"} if where == "attr" else {}
    p.ops = [Op("Relu", ["x"], [y], attrs)]
    round_trip(p)


@pytest.mark.parametrize("name", ["1-2", "0-a", "inf-x"])
def test_round_trip_digit_dash_names(name):
    p = Program()
    p.add_var(Var(name, "float32", (2,), "input"))
    p.inputs = [name]
    round_trip(p)


# --- parse errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "bad"),
    [
        (["program p", "vars:", "  x: float99[2] input"], 3),  # unknown dtype
        (["program p", "vars:", "  x: float32[2] inptu"], 3),  # unknown kind
        (["program p", "vars:", "  x float32[2]"], 3),  # missing colon
        (["program p", "vars:", "  x: float32[2] input extra"], 3),  # trailing junk
        (["program p", "vars:", "  x: float32[2]", "  x: float32[2]"], 4),  # duplicate var
        (["program p", "inputz: x"], 2),  # unknown header
        (["program p", "  x: float32[2]"], 2),  # indented outside a section
        (["program p", "ops:", "  y = Relu(x", "  z = Relu(y)"], 3),  # unclosed call
        (["program p", "ops:", "  y = Relu(x)  # role=forwrd"], 3),  # unknown role
        (["program p", "ops:", "  y = Relu(x, a=1, z)  # role=forward"], 3),  # input after attr
        (["program p", "ops:", "  y = Relu(x) junk  # role=forward"], 3),
        (["program p", "ops:", "  y = Relu(x, a=tensor)  # role=forward"], 3),
        (["program p", "ops:", "  y = Relu(x, a=None5$)  # role=forward"], 3),
        (["program p", "ops:", "  y = Relu  # role=forward"], 3),  # no call
        (["program p", "ops:", "  y = Relu(x)  # role"], 3),  # field without value
        (["program p", "ops:", "  y = Relu(x)  # role=forward stage=one"], 3),
        (["program p", "updates:", "  w -> w@NEW"], 3),
        (["program p", "loss:"], 2),
        (["program p", "vars:", '  "x: float32[2]'], 3),  # unterminated quote
        (["program p", "vars:", "  w: float32[3,2] param split(axis=0, parts=2, blocks=[4])"], 3),  # 4/2 != 3
        (["program p", "vars:", "  w: float32[3,2] param split(axis=0, parts=2)"], 3),  # no blocks
        (["program p", "vars:", "  w: float32[3,2] param split(axis=0, parts=2, blocks=[6], x=1)"], 3),
        (["program p", "vars:", "  w: float32[3,2] param split(axis=2, parts=2, blocks=[6])"], 3),
    ],
)
def test_parse_error_names_line_number_and_line(lines, bad):
    text = "\n".join(lines) + "\n"
    with pytest.raises(ParseError) as e:
        parse_program(text)
    msg = str(e.value)
    assert msg.startswith(f"line {bad}: "), msg
    assert lines[bad - 1].strip() in msg
    assert isinstance(e.value, ValueError)


def test_parse_error_line_number_counts_blank_lines():
    text = "program p\n\n\nvars:\n  x: float32[2] input\n\n  y: bad[2]\n"
    with pytest.raises(ParseError, match=r"^line 7: .*\n  y: bad\[2\]$"):
        parse_program(text)


# --- property-style round trip -----------------------------------------------------------

_NAME_CHARS = "abcxyz_.@/"
_ODD_NAMES = ["a b", "日本", "~", "0", "3.weight", "x,y", 'q"', "True", "tensor", "-inf", "1.5", "é"]
_DTYPES = ["float32", "float16", "bfloat16", "int64", "int32", "bool", "float64", "uint8"]


def _rand_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        if rng.random() < 0.2:
            n = rng.choice(_ODD_NAMES) + rng.choice(["", "", str(rng.randint(0, 9))])
        else:
            n = rng.choice("abcdefghw") + "".join(
                rng.choice(_NAME_CHARS + "0123456789") for _ in range(rng.randint(0, 6))
            )
        if n not in taken:
            taken.add(n)
            return n


def _rand_shape(rng: random.Random):
    r = rng.random()
    if r < 0.1:
        return None
    if r < 0.2:
        return ()
    return tuple(rng.choice([1, 2, 3, 16, 0, "batch", "seq"]) for _ in range(rng.randint(1, 3)))


def _rand_scalar(rng: random.Random):
    return rng.choice(
        [
            rng.randint(-(10**6), 10**6),
            rng.uniform(-1e3, 1e3),
            rng.random() * 10 ** rng.randint(-30, 30),
            float("inf"),
            float("-inf"),
            float("nan"),
            -0.0,
            True,
            False,
            None,
            rng.choice(["pinned", "device", "mean", "x_1", "tensor", "None", "a b", "", "é", "1"]),
        ]
    )


def _rand_attr(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.6 or depth > 1:
        return _rand_scalar(rng)
    if r < 0.85:
        return [_rand_attr(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    dtype = rng.choice([torch.float32, torch.int64, torch.bool, torch.bfloat16])
    shape = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype == torch.int64:
        return torch.randint(-100, 100, shape)
    return torch.randn(shape).to(dtype)


def _rand_constant(rng: random.Random, shape) -> torch.Tensor:
    dtype = rng.choice([torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.float16])
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape)
    return (torch.randn(shape) * 10 ** rng.randint(-5, 5)).to(dtype)


def _random_program(rng: random.Random) -> Program:
    taken: set[str] = set()
    p = Program(_rand_name(rng, set()))
    var_names = []
    for _ in range(rng.randint(0, 10)):
        name = _rand_name(rng, taken)
        kind = rng.choice(VAR_KINDS)
        if kind == "constant":
            shape = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
            value = _rand_constant(rng, shape)
            dtype = str(value.dtype).removeprefix("torch.")
            p.add_var(Var(name, dtype, shape, kind), value)
        else:
            trainable = kind == "param" and rng.random() < 0.7
            p.add_var(Var(name, rng.choice(_DTYPES), _rand_shape(rng), kind, trainable))
            if kind in ("param", "buffer", "opt_state"):
                p.values[name] = torch.zeros(2)
        var_names.append(name)
    pick = (lambda: rng.choice(var_names + [""])) if var_names else (lambda: "")
    for _ in range(rng.randint(0, 8)):
        attrs = {f"a{k}": _rand_attr(rng) for k in range(rng.randint(0, 4))}
        p.ops.append(
            Op(
                rng.choice(["Relu", "MatMul", "Memcpy", "Send", "Adam", "Split", "com.ms.Foo"]),
                [pick() for _ in range(rng.randint(0, 4))],
                [pick() for _ in range(rng.randint(0, 3))],
                attrs,
                role=rng.choice(ROLES),
                stage=rng.choice([None, None, 0, 1, 7]),
                scope=rng.choice(["", "", "fc1", "layers.0.attn", "0", "a b", "~"]),
                origin=rng.choice([None, None, "", *var_names[:3]]),
            )
        )
    if var_names:
        p.inputs = rng.sample(var_names, rng.randint(0, min(3, len(var_names))))
        p.outputs = rng.sample(var_names, rng.randint(0, min(3, len(var_names))))
        if rng.random() < 0.5:
            p.loss_name = rng.choice(var_names)
        for _ in range(rng.randint(0, 3)):
            p.modules[rng.choice(["fc1", "0", "a b", "layers.1", ""])] = rng.sample(
                var_names, rng.randint(0, min(2, len(var_names)))
            )
        for _ in range(rng.randint(0, 2)):
            p.updates[rng.choice(var_names)] = rng.choice(var_names)
    return p


def test_round_trip_random_programs():
    rng = random.Random(20240521)
    torch.manual_seed(0)
    for i in range(50):
        p = _random_program(rng)
        text = print_program(p)
        try:
            q = parse_program(text)
        except ParseError as e:  # pragma: no cover - failure path
            pytest.fail(f"program {i} does not parse back: {e}\n{text}")
        assert print_program(q) == text, f"program {i}:\n{text}"
        assert_same_program(p, q)


def test_structural_comparison_catches_differences():
    """The helper above must be able to fail, or the round-trip tests prove nothing."""
    assert not _same_value(0.0, -0.0)
    assert not _same_value(1, 1.0)
    assert not _same_value(float("nan"), 1.0)
    assert not _same_value("None", None)
    assert not _same_value([1, [2]], [1, [3]])
    assert not _same_value(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert not _same_value(torch.tensor([1.0]), torch.tensor([[1.0]]))
    assert not _same_value(torch.tensor([0.0]), torch.tensor([-0.0]))
    p = _base()
    p.add_var(Var("y", "float32", ("batch", 4)))
    p.ops = [Op("Relu", ["x"], ["y"], {"a": 1}, stage=0)]
    for mutate in (
        lambda q: q.ops[0].attrs.update(a=2),
        lambda q: setattr(q.ops[0], "stage", None),
        lambda q: setattr(q.ops[0], "origin", ""),
        lambda q: setattr(q.vars["y"], "shape", ("batch", "4")),
        lambda q: setattr(q.vars["x"], "trainable", True),
        lambda q: q.modules.update(m=[]),
        lambda q: q.updates.update(x="y"),
    ):
        q = parse_program(print_program(p))
        mutate(q)
        with pytest.raises(AssertionError):
            assert_same_program(p, q)


def test_round_trip_vars_made_on_one_kind_of_device():
    p = _base()
    p.add_var(Var("lse", "float32", ("batch", "(s+31)//32*32"), device="cuda"))
    p.add_var(Var("probs", "float32", ("batch", 4), device="cpu"))
    p.add_var(Var("w", "float32", (4,), "param", trainable=True, split=Split(0, 2, (8,))))
    p.ops = [Op("Split", ["x"], ["lse", "probs"], {"axis": 1})]
    q = round_trip(p)
    assert 'lse: float32[batch,"(s+31)//32*32"] on cuda' in print_program(q)
    assert q.vars["lse"].device == "cuda" and q.vars["probs"].device == "cpu" and q.vars["w"].device is None


def test_an_unknown_device_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match=r"var 'lse': unknown device 'cdua' \(one of cpu, cuda\).*cuda"):
        Var("lse", "float32", (2,), device="cdua")

"""Bad input to import: each error names the thing at fault."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import metaopt
from metaopt.frontend.onnx_import import ImportError_
from metaopt.frontend.safe_load import ModelLoadError


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 10
    return m


def _vi(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def test_unknown_op_is_refused_with_its_name_and_scope():
    node = helper.make_node("FancyOp", ["x"], ["y"], name="n1", domain="acme")
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="['', 'encoder', 'encoder.fancy', 'f']")
    m = _model([node], [_vi("x", [2])], [_vi("y", [2])])
    m.opset_import.append(helper.make_opsetid("acme", 1))
    with pytest.raises(ImportError_, match=r"acme::FancyOp.*encoder\.fancy|FancyOp.*'encoder.fancy'"):
        metaopt.load(m)


def test_control_flow_from_torch_is_refused_naming_op_and_module():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda v: self.fc(v), lambda v: v * 2, (x,)).sum()

    with pytest.raises(ImportError_, match=r"op If .*control flow"):
        metaopt.export(Branchy(), (torch.randn(3, 4),))


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_an_opset_whose_semantics_our_kernel_lacks_is_refused_by_name(op):
    """Before opset 13 the softmax family flattened its input at `axis`; the rows say which
    opset their kernels implement (`min_opset`)."""
    node = helper.make_node(op, ["x"], ["y"], name="s1", axis=1)
    g = helper.make_graph([node], "g", [_vi("x", [2, 3, 4])], [_vi("y", [2, 3, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = 7
    with pytest.raises(ImportError_, match=rf"op {op} .*opset 11 .*convert the model to opset 13 or later"):
        metaopt.load(m)


def test_loop_in_onnx_file_is_refused():
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Identity", ["v"], ["v_out"])],
        "body",
        [_vi("i", [], TensorProto.INT64), _vi("c", [], TensorProto.BOOL), _vi("v", [2])],
        [_vi("c_out", [], TensorProto.BOOL), _vi("v_out", [2])],
    )
    loop = helper.make_node("Loop", ["n", "cond", "v0"], ["v_final"], name="the_loop", body=body)
    m = _model(
        [loop],
        [_vi("n", [], TensorProto.INT64), _vi("cond", [], TensorProto.BOOL), _vi("v0", [2])],
        [_vi("v_final", [2])],
    )
    with pytest.raises(ImportError_, match=r"op Loop \(node the_loop.*control flow"):
        metaopt.load(m)


def test_load_round_trip_and_garbage(tmp_path):
    w = onnx.numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    m = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [_vi("x", ["batch", 3])],
        [_vi("y", ["batch", 2])],
        [w],
    )
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    p = metaopt.load(path)
    assert p.vars["w"].kind == "param" and p.vars["w"].trainable
    (y,) = metaopt.Executor().run(p, feed={"x": np.ones((4, 3), np.float32)}, fetch_list=["y"])
    np.testing.assert_array_equal(y, np.full((4, 2), 3.0, np.float32))

    half = tmp_path / "half.onnx"
    half.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="half.onnx") as e:
        metaopt.load(half)
    assert "DecodeError" not in str(e.value)
    txt = tmp_path / "notes.txt"
    txt.write_text("hello, not a model")
    with pytest.raises(ModelLoadError, match="notes.txt"):
        metaopt.load(txt)


def test_export_with_batch_one_is_explained():
    with pytest.raises(metaopt.frontend.torch_export.ExportError, match="batch size 1"):
        metaopt.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))


@torch.library.custom_op("metaopt_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


class _Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _twice(x)


class _NoOnnx(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.act = _Twice()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner(x)).sum()


def test_export_failure_names_the_op_and_suggests_no_wrong_cure():
    with pytest.raises(metaopt.frontend.torch_export.ExportError) as err:
        metaopt.export(_NoOnnx(), (torch.randn(4, 3),))
    msg = str(err.value)
    assert "metaopt_test" in msg and "twice" in msg, msg
    assert "_NoOnnx" in msg and "in module 'act'" in msg, msg
    assert "dynamic_batch" not in msg  # the batch has nothing to do with it

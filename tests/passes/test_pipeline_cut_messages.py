"""A cut naming a var that exists but cannot begin a stage says why, never 'did you mean' itself."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import metaopt
from metaopt.ir import did_you_mean
from metaopt.passes.pipeline import PipelineError, plan_pipeline


def _mlp() -> metaopt.Program:
    inits = [onnx.numpy_helper.from_array(np.ones((3, 3), np.float32), n) for n in ("w1", "w2")]
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["input_ids", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["a"]),
            helper.make_node("MatMul", ["a", "w2"], ["o"]),
            helper.make_node("ReduceMean", ["o"], ["loss"], keepdims=0),
        ],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 10
    return metaopt.load(m)


@pytest.mark.parametrize(("cut", "kind"), [("input_ids", "input"), ("w2", "param")])
def test_cut_on_a_var_no_forward_op_produces(cut, kind):
    with pytest.raises(PipelineError) as info:
        plan_pipeline(_mlp(), num_stages=2, cuts=[cut], grads={})
    message = str(info.value)
    assert f"{cut!r} is a {kind} var produced by no op" in message
    assert "did you mean" not in message


def test_misspelt_cut_still_gets_a_suggestion():
    with pytest.raises(PipelineError, match=r"'aa' is neither a module path nor a forward var \(did you"):
        plan_pipeline(_mlp(), num_stages=2, cuts=["aa"], grads={})


def test_did_you_mean_never_suggests_the_word_itself():
    assert did_you_mean("input_ids", ["input_ids", "labels"]) == ""
    assert did_you_mean("Input_ids", ["input_ids"]) == " (did you mean 'input_ids'?)"

"""Standard-ops definitions of our own op types, saved as ONNX model-local functions.

They let ONNX Runtime (and any ONNX consumer) run a saved training program that
uses metaopt ops. Only ops with an exact standard-ops equivalent appear here; each op's row
names its body (``onnx_function``) and, where a node's inputs choose among several, which one
it calls (``onnx_overload``): frontend/onnx_save.py asks the rows.
"""

from __future__ import annotations

import onnx
from onnx import helper

DOMAIN = "metaopt"


def _ref(name: str, ref: str, kind: int) -> onnx.AttributeProto:
    a = onnx.AttributeProto()
    a.name, a.ref_attr_name, a.type = name, ref, kind
    return a


def _const(out: str, **kw) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [out], **kw)


def _running_update(stat: str, batch: str) -> list[onnx.NodeProto]:
    """``running_<stat> = <stat> * keep + <batch> * m_x`` (keep = 1 - momentum): torch's running
    statistics update, the same for the mean and the variance."""
    n = helper.make_node
    return [
        n("Mul", [stat, "keep"], [f"old_{stat}"]),
        n("Mul", [batch, "m_x"], [f"new_{stat}_part"]),
        n("Add", [f"old_{stat}", f"new_{stat}_part"], [f"running_{stat}"]),
    ]


def batch_norm_training() -> onnx.FunctionProto:
    """torch's training batch norm: batch stats; running var updated with the unbiased variance."""
    n = helper.make_node
    m = _const("m")
    m.attribute.append(_ref("value_float", "momentum", onnx.AttributeProto.FLOAT))
    eps = n("BatchNormalization", ["X", "scale", "B", "bmean", "bvar"], ["Y"])
    eps.attribute.append(_ref("epsilon", "epsilon", onnx.AttributeProto.FLOAT))
    nodes = [
        n("Shape", ["X"], ["shape"]),
        n("Size", ["shape"], ["rank"]),
        _const("zero", value=helper.make_tensor("", onnx.TensorProto.INT64, [1], [0])),
        _const("two", value=helper.make_tensor("", onnx.TensorProto.INT64, [], [2])),
        _const("one_i", value=helper.make_tensor("", onnx.TensorProto.INT64, [], [1])),
        n("Range", ["two", "rank", "one_i"], ["rest"]),
        n("Concat", ["zero", "rest"], ["axes"], axis=0),
        n("ReduceMean", ["X", "axes"], ["bmean_k"], keepdims=1),
        n("Sub", ["X", "bmean_k"], ["d"]),
        n("Mul", ["d", "d"], ["d2"]),
        n("ReduceMean", ["d2", "axes"], ["bvar"], keepdims=0),
        n("ReduceMean", ["X", "axes"], ["bmean"], keepdims=0),
        eps,
        n("Size", ["X"], ["numel"]),
        n("Size", ["bmean"], ["channels"]),
        n("Div", ["numel", "channels"], ["count_i"]),
        n("CastLike", ["count_i", "X"], ["count"]),
        _const("one", value_float=1.0),
        n("CastLike", ["one", "X"], ["one_x"]),
        n("Sub", ["count", "one_x"], ["count_m1"]),
        n("Div", ["count", "count_m1"], ["bessel"]),
        n("Mul", ["bvar", "bessel"], ["uvar"]),
        m,
        n("CastLike", ["m", "X"], ["m_x"]),
        n("Sub", ["one_x", "m_x"], ["keep"]),
        *_running_update("mean", "bmean"),
        *_running_update("var", "uvar"),
    ]
    return helper.make_function(
        DOMAIN,
        "BatchNormTraining",
        ["X", "scale", "B", "mean", "var"],
        ["Y", "running_mean", "running_var"],
        nodes,
        [helper.make_opsetid("", 20)],
        attributes=["epsilon", "momentum"],
    )


def linear() -> list[onnx.FunctionProto]:
    """torch.nn.Linear on any rank: MatMul(x, Transpose(W)) (+ b). Two overloads (IR 10), as a
    function body cannot test for an omitted input: the plain one with a bias, and ``"no_bias"``
    (`overload_of`: LLaMA's projections, tied LM heads)."""
    n = helper.make_node
    product = [n("Transpose", ["weight"], ["wt"], perm=[1, 0]), n("MatMul", ["x", "wt"], ["xw"])]
    with_bias = helper.make_function(
        DOMAIN,
        "Linear",
        ["x", "weight", "bias"],
        ["y"],
        [*product, n("Add", ["xw", "bias"], ["y"])],
        [helper.make_opsetid("", 20)],
    )
    without = helper.make_function(
        DOMAIN,
        "Linear",
        ["x", "weight"],
        ["y"],
        [product[0], n("MatMul", ["x", "wt"], ["y"])],
        [helper.make_opsetid("", 20)],
    )
    without.overload = "no_bias"
    return [with_bias, without]


def embedding() -> onnx.FunctionProto:
    """torch's F.embedding forward (its attrs matter only to the gradient)."""
    nodes = [helper.make_node("Gather", ["weight", "indices"], ["output"], axis=0)]
    return helper.make_function(
        DOMAIN,
        "Embedding",
        ["weight", "indices"],
        ["output"],
        nodes,
        [helper.make_opsetid("", 20)],
        attributes=["padding_idx", "scale_grad_by_freq"],
    )


def linear_cross_entropy() -> onnx.FunctionProto:
    """The fused LM head + loss, unchunked: Gemm(x as [N, H], W, b) -> SoftmaxCrossEntropyLoss
    (`chunk_size` only bounds our kernel's memory; the value is the same)."""
    n = helper.make_node
    gemm = n("Gemm", ["x2", "weight", "bias"], ["logits"])
    gemm.attribute.append(_ref("transB", "transB", onnx.AttributeProto.INT))
    sce = n("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])
    sce.attribute.append(_ref("ignore_index", "ignore_index", onnx.AttributeProto.INT))
    sce.attribute.append(_ref("reduction", "reduction", onnx.AttributeProto.STRING))
    nodes = [
        n("Shape", ["x"], ["h"], start=-1),
        _const("minus1", value=helper.make_tensor("", onnx.TensorProto.INT64, [1], [-1])),
        n("Concat", ["minus1", "h"], ["x2_shape"], axis=0),
        n("Reshape", ["x", "x2_shape"], ["x2"]),
        n("Reshape", ["labels", "minus1"], ["y"]),
        gemm,
        sce,
    ]
    return helper.make_function(
        DOMAIN,
        "LinearCrossEntropy",
        ["x", "weight", "labels", "bias"],
        ["loss"],
        nodes,
        [helper.make_opsetid("", 20)],
        attributes=["ignore_index", "reduction", "chunk_size", "transB"],
    )


def rms_norm() -> onnx.FunctionProto:
    """HF's RMSNorm over the last dim: scale * X / sqrt(ReduceMean(X * X) + epsilon) (opset 20:
    ONNX's RMSNormalization needs 23)."""
    n = helper.make_node
    eps = _const("eps_f")
    eps.attribute.append(_ref("value_float", "epsilon", onnx.AttributeProto.FLOAT))
    nodes = [
        n("Mul", ["X", "X"], ["sq"]),
        _const("last", value=helper.make_tensor("", onnx.TensorProto.INT64, [1], [-1])),
        n("ReduceMean", ["sq", "last"], ["ms"], keepdims=1),
        eps,
        n("CastLike", ["eps_f", "X"], ["eps"]),
        n("Add", ["ms", "eps"], ["var"]),
        n("Sqrt", ["var"], ["rms"]),
        n("Div", ["X", "rms"], ["xhat"]),
        n("Mul", ["xhat", "scale"], ["Y"]),
    ]
    return helper.make_function(
        DOMAIN, "RMSNorm", ["X", "scale"], ["Y"], nodes, [helper.make_opsetid("", 20)], attributes=["epsilon"]
    )


def silu() -> onnx.FunctionProto:
    """nn.SiLU: X * Sigmoid(X) (ONNX's Swish needs opset 24)."""
    n = helper.make_node
    nodes = [n("Sigmoid", ["X"], ["s"]), n("Mul", ["X", "s"], ["Y"])]
    return helper.make_function(DOMAIN, "Silu", ["X"], ["Y"], nodes, [helper.make_opsetid("", 20)])


def quick_gelu() -> onnx.FunctionProto:
    """CLIP's QuickGELU: X * Sigmoid(alpha * X) (ONNX's Swish needs opset 24)."""
    n = helper.make_node
    alpha = _const("alpha_f")
    alpha.attribute.append(_ref("value_float", "alpha", onnx.AttributeProto.FLOAT))
    nodes = [
        alpha,
        n("CastLike", ["alpha_f", "X"], ["alpha"]),
        n("Mul", ["X", "alpha"], ["ax"]),
        n("Sigmoid", ["ax"], ["s"]),
        n("Mul", ["X", "s"], ["Y"]),
    ]
    return helper.make_function(
        DOMAIN, "QuickGelu", ["X"], ["Y"], nodes, [helper.make_opsetid("", 20)], attributes=["alpha"]
    )


def silu_mul() -> onnx.FunctionProto:
    """The SiLU-gated MLP's gate: A * Sigmoid(A) * B (ONNX's SwiGLU needs opset 28)."""
    n = helper.make_node
    nodes = [n("Sigmoid", ["A"], ["s"]), n("Mul", ["A", "s"], ["g"]), n("Mul", ["g", "B"], ["Y"])]
    return helper.make_function(DOMAIN, "SiluMul", ["A", "B"], ["Y"], nodes, [helper.make_opsetid("", 20)])


def rotary() -> onnx.FunctionProto:
    """Rotary position embedding: X * cos + cat(-X2, X1) * sin, X1 and X2 the halves of X's last dim."""
    n = helper.make_node
    nodes = [
        n("Shape", ["X"], ["d"], start=-1),
        _const("two", value=helper.make_tensor("", onnx.TensorProto.INT64, [1], [2])),
        n("Div", ["d", "two"], ["h"]),
        n("Concat", ["h", "h"], ["sizes"], axis=0),
        n("Split", ["X", "sizes"], ["x1", "x2"], axis=-1),
        n("Neg", ["x2"], ["nx2"]),
        n("Concat", ["nx2", "x1"], ["r"], axis=-1),
        n("Mul", ["X", "cos"], ["a"]),
        n("Mul", ["r", "sin"], ["b"]),
        n("Add", ["a", "b"], ["Y"]),
    ]
    return helper.make_function(
        DOMAIN, "Rotary", ["X", "cos", "sin"], ["Y"], nodes, [helper.make_opsetid("", 20)]
    )


def _attention(inputs: list[str], nodes: list[onnx.NodeProto], overload: str = "") -> onnx.FunctionProto:
    node = helper.make_node("Attention", [*inputs[:3], "mask_q"] if len(inputs) > 3 else inputs, ["y"])
    node.attribute.append(_ref("scale", "scale", onnx.AttributeProto.FLOAT))
    f = helper.make_function(
        DOMAIN,
        "ScaledDotProductAttention",
        inputs,
        ["y"],
        [*nodes, node],
        [helper.make_opsetid("", 23)],
        attributes=["scale", "dropout_p"],
    )
    f.overload = overload
    return f


def scaled_dot_product_attention() -> list[onnx.FunctionProto]:
    """The fused attention's output y: ONNX `Attention` (opset 23) on 4-D Q, K, V with the op's
    scale. Two overloads (IR 10), as a function body cannot test for an omitted input: the plain
    one, and ``"masked"`` (`overload_of`), whose additive or bool mask is first expanded over the
    query positions (ONNX Runtime's Attention refuses a (batch, 1, 1, keys) padding mask that the
    spec lets broadcast). Dropout on the probabilities is a training op (ONNX Runtime drops
    Dropout at inference too); the outputs only our backward reads (log-sum-exp, probabilities,
    mask) are not defined here, so a file whose node uses them runs on our executor only."""
    n = helper.make_node
    expand = [
        n("Shape", ["q"], ["sq"], start=2, end=3),
        n("Shape", ["k"], ["sk"], start=2, end=3),
        _const("ones", value=helper.make_tensor("", onnx.TensorProto.INT64, [2], [1, 1])),
        n("Concat", ["ones", "sq", "sk"], ["full"], axis=0),
        n("Expand", ["attn_mask", "full"], ["mask_q"]),
    ]
    return [_attention(["q", "k", "v"], []), _attention(["q", "k", "v", "attn_mask"], expand, "masked")]


def attention_overload(inputs: list[str]) -> str:
    """The function a saved ScaledDotProductAttention node calls: with a mask or without."""
    return "masked" if len(inputs) > 3 and inputs[3] else ""


def linear_overload(inputs: list[str]) -> str:
    """The function a saved Linear node calls: with a bias or without."""
    return "no_bias" if len(inputs) < 3 or not inputs[2] else ""

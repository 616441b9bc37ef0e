"""Our translations of aten ops for torch's ONNX exporter, where the stock one loses training meaning.

* ``aten.embedding`` with a ``padding_idx`` (or ``scale_grad_by_freq``): the stock translation is
  a plain ``Gather``, which drops what the backward needs (torch gives the pad row a zero grad).
  It becomes our ``metaopt::Embedding`` (forward = Gather; the attrs drive its gradient). A lookup
  without either keeps the plain ``Gather``. This covers every route into ``aten.embedding``:
  ``nn.Embedding``, ``F.embedding`` and weights tied to an output projection alike (only the
  lookup's contribution to the pad row is dropped: the projection's grad is another op's).

* ``aten.softmax`` / ``aten.log_softmax`` with a ``dtype``: torch casts the input to ``dtype``
  first and normalises in it; the stock translation normalises in the input's dtype and casts
  after (HF Funnel's float64 scores came out float32-precise). Ours casts first, as torch does.

* ``transformers::grouped_mm_fallback`` and ``aten._grouped_mm`` (2-D tokens by 3-D experts, with
  offsets): the grouped matmul HF's mixture-of-experts layers run over tokens sorted by expert.
  Neither has a stock translation (transformers' own ONNX path unrolls one MatMul per expert).
  Both become our ``metaopt::GroupedMatMul``, which holds every expert whatever the example
  input routes.

* ``aten.dropout_`` (``nn.Dropout(inplace=True)``) and ``aten.feature_dropout(_)``
  (``nn.Dropout1d/2d/3d``, ``F.dropout2d``) are not translations but decompositions run on the
  captured graph first (`dropout_forms`): the exporter would decompose them into a Bernoulli draw
  and arithmetic, which a program cannot tell from a model's own randomness, so its evaluation
  form (``Program.clone(for_test=True)``) would keep drawing. Both become ``aten.dropout``, which
  exports as ONNX ``Dropout``: the in-place one as itself, out of place; the feature one as the
  input times a dropout of ones of shape [N, C, 1, ...] (torch's own form: one draw per channel,
  scaled by 1/(1-p)), so an eval program's Identity leaves the input as it is. ``alpha_dropout``
  keeps the stock route (its eval form is not an identity of the mask: see docs/evaluation.md).

* ``aten.histc`` of integers: HF's mixture-of-experts layers count the tokens of each expert with
  ``histc`` of the expert ids, as floats on a CPU but as ints elsewhere, the meta device too;
  the stock translation takes floats only (an assertion: DeepSeek-V3 did not export on meta).
  Ours counts the ids as floats (exact below 2^24) and returns the input's type, as torch does.

The exporter needs an ONNX schema for any op a translation emits; ours are registered in the
``metaopt`` domain once per process.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import torch
from onnx import defs
from onnxscript import opset18 as onnx_op
from onnxscript import values

DOMAIN = "metaopt"
FLOATS = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]


@functools.cache
def _opset() -> values.Opset:
    if not defs.has("Embedding", DOMAIN):
        attr = defs.OpSchema.Attribute
        defs.register_schema(
            defs.OpSchema(
                "Embedding",
                DOMAIN,
                1,
                doc="torch.nn.functional.embedding: Gather(weight, indices, axis=0); padding_idx and "
                "scale_grad_by_freq change only the weight's gradient, as in torch",
                inputs=[
                    defs.OpSchema.FormalParameter("weight", "T"),
                    defs.OpSchema.FormalParameter("indices", "I"),
                ],
                outputs=[defs.OpSchema.FormalParameter("output", "T")],
                type_constraints=[("T", FLOATS, ""), ("I", ["tensor(int64)", "tensor(int32)"], "")],
                attributes=[
                    attr("padding_idx", onnx.helper.make_attribute("padding_idx", -1), "row whose grad is 0"),
                    attr("scale_grad_by_freq", onnx.helper.make_attribute("scale_grad_by_freq", 0), ""),
                ],
            )
        )
    if not defs.has("GroupedMatMul", DOMAIN):
        defs.register_schema(
            defs.OpSchema(
                "GroupedMatMul",
                DOMAIN,
                1,
                doc="torch.nn.functional.grouped_mm(x, weight, offs=offsets): rows of x sorted by "
                "expert, offsets the cumulative row counts; rows past the last offset are zero",
                inputs=[
                    defs.OpSchema.FormalParameter("x", "T"),
                    defs.OpSchema.FormalParameter("weight", "T"),
                    defs.OpSchema.FormalParameter("offsets", "I"),
                ],
                outputs=[defs.OpSchema.FormalParameter("output", "T")],
                type_constraints=[("T", FLOATS, ""), ("I", ["tensor(int64)", "tensor(int32)"], "")],
            )
        )
    return values.Opset(DOMAIN, 1)


def _embedding(
    weight, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False, sparse: bool = False
):
    # A negative padding_idx reaches aten already normalised (nn.Embedding adds num_embeddings);
    # -1 means none. `sparse` only changes the grad's layout in torch, not its values.
    if padding_idx is None or (padding_idx < 0 and not scale_grad_by_freq):
        return onnx_op.Gather(weight, indices, axis=0)
    return _opset().Embedding(
        weight, indices, padding_idx=int(padding_idx), scale_grad_by_freq=int(bool(scale_grad_by_freq))
    )


def _softmax(self, dim: int, dtype: int = -1):
    if dtype is not None and dtype != -1:
        self = onnx_op.Cast(self, to=dtype)
    return onnx_op.Softmax(self, axis=dim)


def _log_softmax(self, dim: int, dtype: int = -1):
    if dtype is not None and dtype != -1:
        self = onnx_op.Cast(self, to=dtype)
    return onnx_op.LogSoftmax(self, axis=dim)


def _grouped_mm_fallback(input, weight, offs):
    return _opset().GroupedMatMul(input, weight, offs)


def _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    # torch._grouped_mm also has 2-D x 2-D and 3-D x 3-D forms and a bias; HF's experts use only
    # this one (tokens [S, K] by experts [E, K, N] with offsets).
    if offs is None or bias is not None or out_dtype is not None:
        raise NotImplementedError(
            "metaopt translates aten._grouped_mm only as tokens [S, K] by experts [E, K, N] with "
            "offs, no bias, no out_dtype (what HF's mixture-of-experts layers call)"
        )
    if len(self.shape) != 2 or len(mat2.shape) != 3:
        raise NotImplementedError(
            f"metaopt translates aten._grouped_mm of a 2-D input by a 3-D weight only, got ranks "
            f"{len(self.shape)} and {len(mat2.shape)}"
        )
    return _opset().GroupedMatMul(self, mat2, offs)


def _histc(self, bins: int = 100, min: float = 0.0, max: float = 0.0):  # noqa: A002 - torch's names
    # torch's own rule: `bins` equal bins over [min, max], max included, values outside (and NaN)
    # dropped; counted in float32 (exact below 2^24) as how many values lie below each edge
    ints = (onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64)
    if int(self.dtype) not in ints:  # floats: torch's own translation, as before
        from onnxscript.function_libs.torch_lib.ops.core import aten_histc

        return aten_histc(self, bins, min, max)
    if min == max:
        raise NotImplementedError(f"metaopt translates aten.histc with min < max only, got {min} == {max}")
    edges = np.array([min + (max - min) / bins * i for i in range(bins + 1)], dtype=np.float32)
    edges[-1] = np.nextafter(edges[-1], np.float32(np.inf))  # max itself in the last bin
    column = onnx_op.Constant(value=onnx.numpy_helper.from_array(edges.reshape(-1, 1)))
    flat = onnx_op.Reshape(onnx_op.Cast(self, to=onnx.TensorProto.FLOAT), [-1])
    inside = onnx_op.And(onnx_op.GreaterOrEqual(flat, [float(min)]), onnx_op.LessOrEqual(flat, [float(max)]))
    clipped = onnx_op.Where(inside, flat, [float(min) - 1.0])  # below every edge: in no bin
    below = onnx_op.Cast(onnx_op.Less(onnx_op.Unsqueeze(clipped, [0]), column), to=onnx.TensorProto.FLOAT)
    sums = onnx_op.ReduceSum(below, [1], keepdims=0)
    counts = onnx_op.Sub(onnx_op.Slice(sums, [1], [bins + 1]), onnx_op.Slice(sums, [0], [bins]))
    return onnx_op.Cast(counts, to=int(self.dtype))


def _transformers_ops() -> dict:
    """transformers' custom ops, where this process has registered them (importing its MoE code)."""
    ns = getattr(torch.ops, "transformers", None)
    op = getattr(ns, "grouped_mm_fallback", None) if ns is not None else None
    return {op.default: _grouped_mm_fallback} if op is not None else {}


def dropout_forms(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`ep` (in place) with in-place and feature dropouts written as ``aten.dropout`` (module doc),
    before the exporter's decomposition would turn them into Bernoulli draws."""
    aten = torch.ops.aten
    graph = ep.graph_module.graph
    changed = False
    for node in list(graph.nodes):
        if node.target in (aten.feature_dropout.default, aten.feature_dropout_.default):
            _feature_dropout(graph, node)
            changed = True
        elif node.target is aten.dropout_.default and node.args[0].op != "placeholder":
            _out_of_place(graph, node, aten.dropout.default)
            changed = True
    if changed:
        graph.lint()
        ep.graph_module.recompile()
    return ep


def _out_of_place(graph, node, target) -> None:  # noqa: ANN001
    """`node` (an in-place op on a value the graph made) as its functional `target`: every later
    reader of the mutated value reads `node`'s result instead, as it saw the mutation in eager."""
    x = node.args[0]
    node.target = target
    later = False
    for n in graph.nodes:
        if n is node:
            later = True
        elif later and x in n.all_input_nodes:
            n.replace_input_with(x, node)


def _feature_dropout(graph, node) -> None:  # noqa: ANN001
    """x * dropout(ones of x's [N, C, 1, ...]): torch's feature dropout (one draw per channel,
    scaled by 1/(1-p)) through aten.dropout, the symbolic batch kept (slices, no sizes read)."""
    aten = torch.ops.aten
    x, p, train = node.args[0], node.args[1], node.args[2]
    fake = x.meta["val"]
    with graph.inserting_before(node):
        part = x
        for dim in range(2, fake.dim()):
            part = _node(graph, node, aten.slice.Tensor, (part, dim, 0, 1))
        ones = _node(graph, node, aten.ones_like.default, (part,))
        noise = _node(graph, node, aten.dropout.default, (ones, p, train))
        out = _node(graph, node, aten.mul.Tensor, (x, noise))
    node.replace_all_uses_with(out)
    if node.target is torch.ops.aten.feature_dropout_.default:  # in place: later readers of x
        _redirect_later(graph, out, x)
    graph.erase_node(node)


def _redirect_later(graph, new, x) -> None:  # noqa: ANN001
    later = False
    for n in graph.nodes:
        if n is new:
            later = True
        elif later and x in n.all_input_nodes:
            n.replace_input_with(x, new)


def _node(graph, like, target, args: tuple):  # noqa: ANN001, ANN202
    """A node of `target` with its fake value (computed in the graph's fake mode) and `like`'s
    module metadata (its scope and source line)."""
    n = graph.call_function(target, args)
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    fake = next(v for v in vals if isinstance(v, torch.Tensor))
    with fake.fake_mode:
        n.meta["val"] = target(*vals)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn"):
        if key in like.meta:
            n.meta[key] = like.meta[key]
    return n


def translation_table() -> dict:
    """The `custom_translation_table` metaopt.export hands to torch.onnx.export."""
    _opset()
    aten = torch.ops.aten
    return {
        aten.embedding.default: _embedding,
        aten.softmax.int: _softmax,
        aten.log_softmax.int: _log_softmax,
        aten._grouped_mm.default: _grouped_mm,
        aten.histc.default: _histc,
        **_transformers_ops(),
    }

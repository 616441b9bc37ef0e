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

The exporter needs an ONNX schema for any op a translation emits; ours are registered in the
``metaopt`` domain once per process.
"""

from __future__ import annotations

import functools

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


def translation_table() -> dict:
    """The `custom_translation_table` metaopt.export hands to torch.onnx.export."""
    _opset()
    aten = torch.ops.aten
    return {
        aten.embedding.default: _embedding,
        aten.softmax.int: _softmax,
        aten.log_softmax.int: _log_softmax,
    }

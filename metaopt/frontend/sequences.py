"""Sequence ops -> plain tensors, before import (our IR has tensors only).

torch's exporter turns ``x.split(n, dim)`` into ``SplitToSequence`` read by
``SequenceAt`` with constant positions; that is a ``Split`` with one output per
position read. Any other use of a sequence is refused with the op named.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper


class SequenceError(ValueError):
    pass


_MAX_SIZES = 1 << 16  # split sizes and positions: a few numbers, never a parameter


def _constants(g: onnx.GraphProto) -> dict[str, list[int]]:
    """The small integer initializers and Constant nodes (split sizes, positions) as lists."""
    out = {
        t.name: numpy_helper.to_array(t).reshape(-1).tolist()
        for t in g.initializer
        if t.data_location != onnx.TensorProto.EXTERNAL  # a value by reference: a parameter
        and t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
        and math.prod(t.dims) <= _MAX_SIZES
    }
    for n in g.node:
        if n.op_type == "Constant" and n.attribute:
            a = n.attribute[0]
            if a.name == "value":
                out[n.output[0]] = numpy_helper.to_array(a.t).reshape(-1).tolist()
            elif a.name in ("value_int", "value_ints"):
                out[n.output[0]] = list(helper.get_attribute_value(a)) if a.name == "value_ints" else [a.i]
    return out


def _dim(g: onnx.GraphProto, name: str, axis: int) -> int | None:
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.name == name:
            dims = vi.type.tensor_type.shape.dim
            d = dims[axis]
            return d.dim_value if d.HasField("dim_value") else None
    return None


def split_sequences(model: onnx.ModelProto) -> onnx.ModelProto:
    g = model.graph
    splits = [n for n in g.node if n.op_type == "SplitToSequence"]
    if not splits:
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    consts = _constants(g)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    new_nodes: list[onnx.NodeProto] = []
    drop: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    for node in g.node:
        if node.op_type != "SplitToSequence":
            continue
        seq = node.output[0]
        uses = readers.get(seq, [])
        if not uses or any(u.op_type != "SequenceAt" or u.input[1] not in consts for u in uses):
            raise SequenceError(
                f"SplitToSequence {node.name!r} (output {seq!r}) is read by something other "
                "than SequenceAt at a constant position; sequences are not supported"
            )
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis = attrs.get("axis", 0)
        sizes = consts.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if sizes is None or attrs.get("keepdims", 1) != 1 and len(node.input) < 2:
            raise SequenceError(f"SplitToSequence {node.name!r}: split sizes must be constant")
        if len(sizes) == 1:
            total = _dim(g, node.input[0], axis)
            if total is None:
                raise SequenceError(f"SplitToSequence {node.name!r}: the split axis length is not static")
            n = -(-total // sizes[0])
            sizes = [sizes[0]] * (n - 1) + [total - sizes[0] * (n - 1)]
        outs = [""] * len(sizes)
        for u in uses:
            pos = consts[u.input[1]][0] % len(sizes)
            outs[pos] = u.output[0]
            drop.add(id(u))
        size_name = f"{seq}.sizes"
        g.initializer.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), size_name))
        split = helper.make_node("Split", [node.input[0], size_name], outs, name=node.name, axis=axis)
        split.metadata_props.extend(node.metadata_props)
        replaced[id(node)] = split
    for n in g.node:
        if id(n) in drop:
            continue
        new_nodes.append(replaced.get(id(n), n))
    del g.node[:]
    g.node.extend(new_nodes)
    return model

"""Program -> ONNX ModelProto / file: Netron-readable, ONNX Runtime-runnable where ops allow.

Persistables become initializers (current values from an executor's scope when
given), every var gets its value_info, each op keeps its fields as node
metadata (role, stage, scope, origin). Our own op types live in the
``metaopt`` domain; those with a standard-ops definition are saved with a
model-local function so ONNX Runtime can run the file. State updates
(``Program.updates``) become extra graph outputs named by the new values.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper

from metaopt.atomic import atomic_write
from metaopt.frontend.attrs import float32_literal
from metaopt.ir import TORCH_TO_ONNX, Op, Program, torch_dtype
from metaopt.ops import registry

OPSET = 20
IR_VERSION = 10  # onnxruntime rejects IR 14; 10 is what torch 2.13 writes
DOMAIN = "metaopt"
KIND_KEY = "metaopt.kind"
FROZEN_KEY = "metaopt.frozen"
UPDATE_PREFIX = "metaopt.update."
GRADIENT_MERGE_KEY = "metaopt.gradient_merge"  # a gradient-merge program's GradientMergeInfo
PIPELINE_KEY = "metaopt.pipeline"  # a pipeline stage program's PipelineInfo, as printed
MODULES_KEY = "metaopt.modules"
DERIVED_KEY = "metaopt.derived"  # Program.derived: the non-persistent buffers, JSON names
ATTR_PREFIX = "metaopt.attr."
# attrs metaopt adds to a standard op (a random op's RNG stream under tensor parallel: rng, group)
# that its ONNX schema lacks: kept as node metadata, JSON, or the checker refuses the file
EXTRA_ATTR_PREFIX = "metaopt.extra_attr."
DEVICE_KEY = "metaopt.device"  # Var.device: the one kind of device whose kernels make the var
SPLIT_KEY = "metaopt.split"  # a tensor-parallel var's layout (Var.split), JSON: axis, parts, blocks
ZERO_KEY = "metaopt.zero_shard"  # a ZeRO-sharded var's layout (Var.zero), JSON: parts, full
HOST_KEY = "metaopt.host"  # "1": a persistable held in host memory (Var.host)
OP_FIELD_PREFIX = "metaopt."
DISCARDED_KEY = "metaopt.discarded_outputs"  # output positions named only for the ONNX checker
DISCARDED_SUFFIX = "@DISCARDED"


def _tensor(name: str, t: torch.Tensor) -> onnx.TensorProto:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().view(np.uint16)
        tp = helper.make_tensor(name, onnx.TensorProto.BFLOAT16, list(t.shape), bits.tobytes(), raw=True)
        return tp
    return onnx.numpy_helper.from_array(t.numpy(), name)


def _value_info(p: Program, name: str) -> onnx.ValueInfoProto:
    v = p.vars[name]
    elem = TORCH_TO_ONNX[torch_dtype(v.dtype)]
    shape = None if v.shape is None else list(v.shape)
    return helper.make_tensor_value_info(name, elem, shape)


def _extra_attrs(op: Any) -> set[str]:
    """The attrs of standard op `op` that its ONNX schema does not have."""
    try:
        known = onnx.defs.get_schema(op.type, OPSET).attributes
    except onnx.defs.SchemaError:
        return set()
    return {k for k in op.attrs if k not in known}


def _attr(key: str, value: Any) -> onnx.AttributeProto:
    if isinstance(value, torch.Tensor):
        return helper.make_attribute(key, _tensor("", value))
    if isinstance(value, bool):
        value = int(value)
    if _mixed(value):  # a shape with symbolic dims (Send/Recv): strings in ONNX, exact in metadata
        value = [str(x) for x in value]
    return helper.make_attribute(key, value)


def _mixed(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len({type(x) for x in value}) > 1


def _named_outputs(op: Op, domain: str, i: int) -> tuple[list[str], list[int]]:
    """An output our program leaves unnamed (nothing reads it: recompute re-emits a
    LayerNormalization for its saved mean and rstd only) must still be named where the ONNX
    schema requires it, or the checker refuses the file. Name it after the node and say which
    positions were ours to drop (the importer drops them again)."""
    if "" not in op.outputs or domain != "" or not onnx.defs.has(op.type):
        return list(op.outputs), []
    schema = onnx.defs.get_schema(op.type, OPSET)
    required = [o.option == onnx.defs.OpSchema.FormalParameterOption.Single for o in schema.outputs]
    outputs, discarded = list(op.outputs), []
    for k, name in enumerate(outputs):
        if not name and k < len(required) and required[k]:
            outputs[k] = f"op{i}{DISCARDED_SUFFIX}{k}"
            discarded.append(k)
    return outputs, discarded


def to_model_proto(p: Program, values: Mapping[str, torch.Tensor] | None = None) -> onnx.ModelProto:
    """`values` (e.g. an executor's scope) override the program's initial values."""
    values = values or {}
    inits = []
    for v in p.vars.values():
        if v.persistable:
            t = values.get(v.name, p.values.get(v.name))
            if t is None:
                raise ValueError(f"cannot save {p.name!r}: persistable {v.name!r} has no value")
            inits.append(_tensor(v.name, t))
    nodes, used_domains = [], set()
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        domain = row.domain if row is not None else ""
        used_domains.add(domain)
        outputs, discarded = _named_outputs(op, domain, i)
        node = helper.make_node(op.type, list(op.inputs), outputs, name=f"op{i}", domain=domain)
        if discarded:
            node.metadata_props.add(key=DISCARDED_KEY, value=",".join(map(str, discarded)))
        extra = _extra_attrs(op) if domain == "" else set()
        node.attribute.extend(_attr(k, a) for k, a in op.attrs.items() if k not in extra)
        for k in sorted(extra):
            node.metadata_props.add(key=EXTRA_ATTR_PREFIX + k, value=json.dumps(op.attrs[k]))
        overload = registry.get(op.type).onnx_overload if domain == DOMAIN else None
        if overload is not None:
            node.overload = overload(list(op.inputs))
        for k, a in op.attrs.items():
            # ONNX float attributes are float32; keep the exact value for our own import where
            # what an import reads back from the float32 (attrs.float32_literal) differs.
            if isinstance(a, float) and float32_literal(a) != a and a == a:
                node.metadata_props.add(key=ATTR_PREFIX + k, value=repr(a))
            elif _mixed(a):
                node.metadata_props.add(key=ATTR_PREFIX + k, value=json.dumps(list(a)))
        meta = {"role": op.role, "scope": op.scope}
        if op.stage is not None:
            meta["stage"] = str(op.stage)
        if op.origin is not None:
            meta["origin"] = op.origin
        for k, val in meta.items():
            node.metadata_props.add(key=OP_FIELD_PREFIX + k, value=val)
        nodes.append(node)
    outputs = list(dict.fromkeys([*p.outputs, *p.updates.values()]))
    graph = helper.make_graph(
        nodes,
        p.name,
        [_value_info(p, x) for x in p.inputs],
        [_value_info(p, x) for x in outputs],
        initializer=inits,
        value_info=[_value_info(p, n) for n in p.vars if n not in p.inputs and n not in outputs],
    )
    for vi in [*graph.value_info, *graph.output]:  # what a var is: read back by the importer
        v = p.vars[vi.name]
        if v.device is not None:
            vi.metadata_props.add(key=DEVICE_KEY, value=v.device)
        if v.kind != "activation":
            vi.metadata_props.add(key=KIND_KEY, value=v.kind)
            if v.kind == "param" and not v.trainable:
                vi.metadata_props.add(key=FROZEN_KEY, value="1")
            if v.split is not None:
                sp = {"axis": v.split.axis, "parts": v.split.parts, "blocks": list(v.split.blocks)}
                vi.metadata_props.add(key=SPLIT_KEY, value=json.dumps(sp))
            if v.zero is not None:
                zs = {"parts": v.zero.parts, "full": list(v.zero.full)}
                vi.metadata_props.add(key=ZERO_KEY, value=json.dumps(zs))
            if v.host:
                vi.metadata_props.add(key=HOST_KEY, value="1")
    opsets = [helper.make_opsetid("", OPSET)]
    functions = []
    if DOMAIN in used_domains:
        opsets.append(helper.make_opsetid(DOMAIN, 1))
        functions = _functions({op.type for op in p.ops if registry.get(op.type).domain == DOMAIN})
    _one_default_opset(opsets, functions)
    model = helper.make_model(graph, opset_imports=opsets, functions=functions, producer_name="metaopt")
    model.ir_version = IR_VERSION
    if p.modules:
        model.metadata_props.add(key=MODULES_KEY, value=json.dumps(p.modules))
    derived = sorted(n for n in p.derived if n in p.vars)  # a pass may have dropped one
    if derived:  # not a checkpoint's state: save_pretrained of the loaded program leaves them out
        model.metadata_props.add(key=DERIVED_KEY, value=json.dumps(derived))
    for target, new in p.updates.items():
        model.metadata_props.add(key=UPDATE_PREFIX + target, value=new)
    if p.pipeline is not None:
        model.metadata_props.add(key=PIPELINE_KEY, value=str(p.pipeline))
    if p.gradient_merge is not None:
        model.metadata_props.add(key=GRADIENT_MERGE_KEY, value=str(p.gradient_merge))
    return model


def _one_default_opset(opsets: list, functions: list) -> None:
    """ONNX Runtime runs a function body at the model's default-domain opset: the model and every
    function get the highest any function needs (the fused attention's body is ONNX Attention,
    opset 23; the others are written for OPSET and mean the same at 23)."""
    need = max([OPSET, *(o.version for f in functions for o in f.opset_import if o.domain == "")])
    for o in [*opsets, *(o for f in functions for o in f.opset_import)]:
        if o.domain == "":
            o.version = need


def _functions(op_types: set[str]) -> list[onnx.FunctionProto]:
    """The model-local functions of our op types whose rows have a standard-ops body; an op
    without one cannot be saved runnable elsewhere."""
    out: list[onnx.FunctionProto] = []
    for t in sorted(op_types):
        build = registry.get(t).onnx_function
        if build is not None:
            made = build()
            out += made if isinstance(made, list) else [made]
    return out


def save(p: Program, path: str | os.PathLike, values: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write `p` as an ONNX file, atomically (temp file + rename)."""
    model = to_model_proto(p, values)
    atomic_write(path, lambda f: f.write(model.SerializeToString()))

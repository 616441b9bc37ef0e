"""ONNX ModelProto -> Program.

The importer keeps the exporter's structure and adds what training needs: a
kind per initializer (param / buffer / constant), a module scope per op, shape
and dtype per value, Constant nodes as constant vars. Readable names, training
repairs and folding are separate steps (`naming`, `repair`, passes.fold_constants)
that `import_model` runs in a fixed order.
"""

from __future__ import annotations

import ast
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import numpy_helper

from metaopt import limits as _limits
from metaopt.frontend import onnx_save
from metaopt.frontend.attrs import attr_value, tensor_value
from metaopt.frontend.sequences import split_sequences
from metaopt.ir import Op, Program, Var, did_you_mean, dtype_name, torch_dtype_from_onnx
from metaopt.ir.program import PERSISTABLE_KINDS, GradientMergeInfo, PipelineInfo, Split, ZeroShard
from metaopt.ir.roles import ROLES
from metaopt.ops import registry

_LOG = logging.getLogger("metaopt.load")

CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})
_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
_KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


class ImportError_(ValueError):
    """The model cannot become a metaopt Program; the message names the op or value."""


@dataclass
class ImportOptions:
    """What the caller knows beyond the ONNX file (the torch export wrapper fills it)."""

    # initializer name -> "param" | "buffer" | "constant"; otherwise from the
    # exporter's metadata, else floating initializers are params.
    kinds: dict[str, str] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)  # params with requires_grad=False
    rename: dict[str, str] = field(default_factory=dict)  # initializer -> state_dict name
    symbolic_dims: dict[str, str] = field(default_factory=dict)  # exporter dim name -> ours
    # initializer -> its value by reference (the module's own tensor, or a meta tensor: no value):
    # the file holds only its dtype and dims (`by_reference` in torch_export.py)
    values: dict[str, Any] = field(default_factory=dict)


def _meta(proto: onnx.NodeProto | onnx.ValueInfoProto | onnx.ModelProto) -> dict[str, str]:
    m = {p.key: p.value for p in proto.metadata_props}
    if not all(type(k) is str and type(v) is str for k, v in m.items()):  # invalid UTF-8 comes as bytes
        bad = next(k for k, v in m.items() if type(k) is not str or type(v) is not str)
        if isinstance(proto, onnx.NodeProto):
            what = f"op {proto.op_type} (node {proto.name!r})"
        else:
            what = f"value {proto.name!r}" if isinstance(proto, onnx.ValueInfoProto) else "the model"
        raise ImportError_(f"{what}: metadata key {bad!r} or its value is not UTF-8 text")
    return m


def node_scope(node: onnx.NodeProto) -> tuple[str, list[str]]:
    """(innermost module path, all enclosing module paths outermost first, FX name last).

    The exporter records ``['', 'layer.0', 'layer.0.fc', 'linear']``: module
    paths from the root down, then the FX node's name.
    """
    raw = _meta(node).get(_SCOPES_KEY) if node.metadata_props else None  # most nodes have none
    if not raw:
        return "", []
    try:
        parts = ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        # The exporter's own metadata, but read from an untrusted file: a deeply nested
        # literal must not escape as RecursionError; without it the op just has no scope.
        return "", []
    if not isinstance(parts, list) or not parts or parts[0] == _NO_MODULE:
        return "", [str(p) for p in parts[-1:]] if parts else []
    mods = [str(p) for p in parts[1:-1]]
    return (mods[-1] if mods else ""), [*mods, str(parts[-1])]


def _shape_of(t: onnx.TypeProto, dims: dict[str, str]) -> tuple | None:
    tt = t.tensor_type
    if not tt.HasField("shape"):
        return None
    out: list[int | str] = []
    for d in tt.shape.dim:
        which = d.WhichOneof("value")
        if which == "dim_value":
            out.append(int(d.dim_value))
        elif which == "dim_param":
            out.append(dims.get(d.dim_param, d.dim_param))
        else:
            return None
    return tuple(out)


Types = dict[str, tuple[str, tuple | None]]  # value name -> (dtype name, shape or None)


def _value_types(graph: onnx.GraphProto, dims: dict[str, str]) -> Types:
    # A 100k-node graph has 100k values and a handful of distinct types: each type is read
    # once, keyed by its bytes (reading a TypeProto field by field makes a Python object per
    # field: most of this function's time), and equal shapes share one tuple (one object for
    # the garbage collector to walk, not one per value).
    out: Types = {}
    seen: dict[bytes, tuple[str, tuple | None] | None] = {}
    for values in (graph.input, graph.value_info, graph.output):
        for vi in values:
            t = vi.type
            key = t.SerializeToString()
            if key not in seen:
                seen[key] = _tensor_type(t, dims, vi.name)
            typed = seen[key]
            if typed is not None:
                out[vi.name] = typed
    return out


def _tensor_type(t: onnx.TypeProto, dims: dict[str, str], name: str) -> tuple[str, tuple | None] | None:
    """(dtype name, shape or None) of a tensor type; None for another type or no elem type."""
    if not t.HasField("tensor_type") or not t.tensor_type.elem_type:
        return None
    dtype = torch_dtype_from_onnx(t.tensor_type.elem_type, what=f"value {name!r}")
    return dtype_name(dtype), _shape_of(t, dims)


def _with_inferred_types(model: onnx.ModelProto, dims: dict[str, str]) -> tuple[onnx.ModelProto, Types]:
    """The model with its values typed, and their types (`_value_types` with `dims`)."""
    # The exporter leaves some helper values (shape arithmetic) untyped; ONNX's
    # own inference fills them in, keeping the exporter's symbolic dim names.
    known = {vi.name for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    known |= {t.name for t in model.graph.initializer}
    # the values the importer types (a Constant's value gives its type)
    needed = [o for node in model.graph.node if node.op_type != "Constant" for o in node.output if o]
    if all(o in known for o in needed):
        return model, _value_types(model.graph, dims)
    try:
        # Without data propagation onnx computes shapes only (no values), so a file cannot
        # make it allocate; its answer tells whether propagation would stay bounded.
        plain = onnx.shape_inference.infer_shapes(model, data_prop=False)
        types = _value_types(plain.graph, dims)
        if _all_static(needed, types):
            return plain, types
        risk = _data_prop_risk(plain, _limits.active().max_shape_data)
        if risk is not None:  # the load goes on, some dims symbolic: said, never silent
            _LOG.warning(
                "shape inference without data propagation: %s; some dims stay symbolic (an attention "
                "or a reshape may then stay unfused). %s",
                risk,
                _limits.how_to_raise("max_shape_data"),
            )
            return plain, types
        full = onnx.shape_inference.infer_shapes(model, data_prop=True)
        return full, _value_types(full.graph, dims)
    except onnx.shape_inference.InferenceError as e:
        raise ImportError_(f"ONNX shape inference failed: {e}") from e
    except MemoryError as e:  # a size onnx could not even reserve (bad_alloc)
        raise ImportError_(f"ONNX shape inference ran out of memory (an absurd size in the file): {e}") from e


def _all_static(names: list[str], types: Types) -> bool:
    """Has every value of `names` a tensor type (`types`) with every dim a number? Then data
    propagation has nothing to add (it only pins dims plain inference could not), and its
    second pass over the model (a quarter of a 100k-node load) is skipped."""
    for o in names:
        shape = types.get(o, (None, None))[1]
        if shape is None or not all(type(d) is int for d in shape):
            return False
    return True


# Ops whose output shape onnx infers from the *values* of these inputs: with data propagation
# those values may come from computed shapes, so the output's size is not known beforehand.
_SHAPE_FROM_VALUES = {
    "ConstantOfShape": (0,),
    "Expand": (1,),
    "Tile": (1,),
    "Reshape": (1,),
    "Pad": (1,),
    "Resize": (2, 3),
    "Upsample": (1,),
    "OneHot": (1,),
    "CenterCropPad": (1,),
    "Col2Im": (1, 2),
}


_INT_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
_SENTINEL = 1 << 62


def _data_prop_risk(inferred: onnx.ModelProto, max_elements: int) -> str | None:
    """Why onnx's data propagation could allocate without bound on this model, or None.

    Measured on onnx 1.23: data propagation turns every rank-0/1 value it visits into a
    TensorShapeProto with one dim (~140 bytes) per element, whatever its dtype; a 148-byte
    ``Range(0, 4e8)`` feeding an Add makes it build 4e8 dims (56 GB). Its cost is the total
    length of the rank-0/1 values. Shape inference without propagation (`inferred`) knows
    those lengths, except where an op takes its output shape from a *computed* input
    (``_SHAPE_FROM_VALUES``): propagation may then derive a static length from the static
    dims and integer constants of the file. So: the known lengths must fit `max_elements`,
    and where computed shapes exist, so must every static dim and integer constant (a
    length propagation derives is made of them).
    Known gap: a product of several such numbers (Mul in a shape chain) can exceed each of
    them; reaching onnx's bound then needs a shape chain feeding a ConstantOfShape/Expand.
    """
    g = inferred.graph
    consts: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.output and len(n.attribute) == 1 and n.attribute[0].HasField("t"):
            consts[n.output[0]] = n.attribute[0].t
    total, seed = 0, 0
    for vi in [*g.input, *g.value_info, *g.output]:
        dims = vi.type.tensor_type.shape.dim
        static = [d.dim_value for d in dims if d.HasField("dim_value")]
        seed = max([seed, *static])
        if len(dims) == 1 and static:
            total += static[0]
    for t in consts.values():
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue  # a value by reference (an export's params): no shape data, and not in the file
        if len(t.dims) <= 1:
            total += t.dims[0] if t.dims else 1
            if t.data_type in _INT_TYPES and (not t.dims or t.dims[0] <= 64):
                values = [abs(int(v)) for v in numpy_helper.to_array(t).reshape(-1).tolist()]
                # Slice's "to the end" sentinels (INT64_MAX/MIN) are not sizes; as a size
                # propagation fails at once (bad_alloc, reported as a load error).
                seed = max([seed, *(v for v in values if v < _SENTINEL)])
    if total > max_elements:
        return f"its rank-0/1 values hold {total} elements, over max_shape_data={max_elements}"
    if seed > max_elements:
        for node in g.node:
            for i in _SHAPE_FROM_VALUES.get(node.op_type, ()):
                if i < len(node.input) and node.input[i] and node.input[i] not in consts:
                    return (
                        f"op {node.op_type} (outputs {list(node.output)}) takes its shape from a computed "
                        f"value and the file holds a dim or constant of {seed}, over "
                        f"max_shape_data={max_elements}"
                    )
    return None


def _referenced(t: onnx.TensorProto, values: dict[str, Any]) -> Any:
    """The value given by reference for initializer `t`, which must say the same dtype and dims."""
    value = values[t.name]
    dtype = torch_dtype_from_onnx(t.data_type, what=f"initializer {t.name!r}")
    if value.dtype != dtype or tuple(value.shape) != tuple(t.dims):
        raise ImportError_(
            f"initializer {t.name!r} is {dtype} {list(t.dims)} in the graph but its value given by "
            f"reference is {value.dtype} {list(value.shape)}"
        )
    return value


def _describe(node: onnx.NodeProto) -> str:
    scope, _ = node_scope(node)
    where = f" in module {scope!r}" if scope else ""
    return f"op {node.op_type} (node {node.name or '?'}, outputs {list(node.output)}){where}"


def check_supported(graph: onnx.GraphProto, opset: int = 20) -> None:
    """Refuse control flow, op types without a kernel and old-opset semantics, naming op and scope."""
    for node in graph.node:
        row = registry.get(node.op_type)
        if row is not None and opset < row.min_opset:
            raise ImportError_(
                f"{_describe(node)}: opset {opset} semantics (flatten at axis) are not supported; "
                f"convert the model to opset {row.min_opset} or later"
            )
        if node.op_type in CONTROL_FLOW:
            raise ImportError_(f"{_describe(node)}: control flow is not supported (one block only)")
        if node.op_type == "Constant":
            continue
        row = registry.get(node.op_type)
        if row is None or (node.domain not in ("", "ai.onnx") and node.domain != row.domain):
            dom = f"{node.domain}::" if node.domain else ""
            raise ImportError_(
                f"{_describe(node)}: unknown op type {dom}{node.op_type} (no kernel in the op table)"
            )


def to_program(
    model: onnx.ModelProto, opts: ImportOptions | None = None, *, name: str = "main"
) -> tuple[Program, dict[str, list[str]]]:
    """The raw import: one Op per node, vars for every value, no renaming.

    Also returns each op's scope chain (enclosing module paths, then the FX node
    name), keyed by the op's first output name (stable through folding), for
    the naming step.
    """
    opts = opts or ImportOptions()
    model = split_sequences(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 20)
    check_supported(model.graph, opset)
    model, types = _with_inferred_types(model, opts.symbolic_dims)
    g = model.graph
    # (looked up with a default of {}: values without metadata, nearly all, are left out)
    meta = {vi.name: _meta(vi) for vi in [*g.value_info, *g.output] if vi.metadata_props}
    torch_kinds = {"PARAMETER": "param", "BUFFER": "buffer"}
    p = Program(name)
    chains: dict[str, list[str]] = {}
    rn = opts.rename.get

    init_names = set()
    for t in g.initializer:
        value = _referenced(t, opts.values) if t.name in opts.values else tensor_value(t)
        m = meta.get(t.name, {})
        kind = (
            opts.kinds.get(t.name)
            or m.get(onnx_save.KIND_KEY)
            or torch_kinds.get(m.get(_KIND_KEY, ""))
            or ("param" if value.is_floating_point() else "constant")
        )
        vname = rn(t.name, t.name)
        init_names.add(t.name)
        if vname in p.vars:  # two initializers for one tied parameter
            continue
        frozen = t.name in opts.frozen or onnx_save.FROZEN_KEY in m
        trainable = kind == "param" and not frozen and value.is_floating_point()
        split = _split_meta(t.name, m[onnx_save.SPLIT_KEY]) if onnx_save.SPLIT_KEY in m else None
        zero = _zero_meta(t.name, m[onnx_save.ZERO_KEY]) if onnx_save.ZERO_KEY in m else None
        try:
            var = Var(
                vname,
                dtype_name(value.dtype),
                tuple(value.shape),
                kind=kind,
                trainable=trainable,
                split=split,
                zero=zero,
                host=m.get(onnx_save.HOST_KEY) == "1" and kind in PERSISTABLE_KINDS,
            )
        except ValueError as e:  # a split that does not fit the shape
            raise ImportError_(f"initializer {t.name!r}: {e}") from None
        p.add_var(var, value)

    for vi in g.input:
        if vi.name in init_names:
            continue
        dtype, shape = types.get(vi.name, (None, None))
        if dtype is None:
            raise ImportError_(f"graph input {vi.name!r} has no tensor type")
        p.add_var(Var(vi.name, dtype, shape, kind="input"))
        p.inputs.append(vi.name)

    # Each protobuf field read below makes a Python object: read once per node (100k nodes).
    for node in g.node:
        has_meta = bool(node.metadata_props)  # scopes, saved op fields: few nodes of most files
        scope, chain = node_scope(node) if has_meta else ("", [])
        op_type, outputs = node.op_type, list(node.output)
        if op_type == "Constant":
            value = _constant_value(node)
            p.add_var(Var(outputs[0], dtype_name(value.dtype), tuple(value.shape), kind="constant"), value)
            continue
        try:
            attrs = {a.name: attr_value(a) for a in node.attribute} if node.attribute else {}
        except (ValueError, NotImplementedError) as e:
            raise ImportError_(f"{_describe(node)}: {e}") from None
        if has_meta:
            outputs = _drop_discarded(node, outputs)
        for o in outputs:
            if not o:
                continue
            dtype, shape = types.get(o, (None, None))
            if dtype is None:
                raise ImportError_(f"{_describe(node)}: output {o!r} has no inferred type")
            m = meta.get(o, {}) if meta else {}
            kind = "grad" if m.get(onnx_save.KIND_KEY) == "grad" else "activation"
            try:
                p.add_var(Var(o, dtype, shape, kind=kind, device=m.get(onnx_save.DEVICE_KEY)))
            except ValueError as e:  # an unknown device in the file's metadata
                raise ImportError_(f"{_describe(node)}: {e}") from None
        inputs = [rn(x, x) for x in node.input] if opts.rename else list(node.input)
        op = Op(op_type, inputs, outputs, attrs, scope=scope)
        if has_meta:
            _restore_fields(op, node)
        if outputs and chain:  # a Send has no outputs; a missing chain reads as empty (naming.py)
            chains[outputs[0]] = chain
        p.ops.append(op)

    for key, value in _meta(model).items():  # a file metaopt saved: its state updates
        if key.startswith(onnx_save.UPDATE_PREFIX):
            p.updates[key[len(onnx_save.UPDATE_PREFIX) :]] = value
        elif key == onnx_save.MODULES_KEY:
            p.modules = _modules(value)
        elif key == onnx_save.DERIVED_KEY:
            p.derived = _derived(value, p)
        elif key == onnx_save.PIPELINE_KEY:
            p.pipeline = _model_meta(key, value, PipelineInfo.parse, _check_pipeline)
        elif key == onnx_save.GRADIENT_MERGE_KEY:
            p.gradient_merge = _model_meta(key, value, GradientMergeInfo.parse, _check_gradient_merge)
    _check_saved_program(p)
    update_outputs = set(p.updates.values())
    p.outputs = [o.name for o in g.output if o.name not in update_outputs]
    if (
        len(p.outputs) == 1
        and p.vars[p.outputs[0]].shape == ()
        and p.vars[p.outputs[0]].dtype.startswith("float")
    ):
        p.loss_name = p.outputs[0]
        for op in p.ops:  # Fleet's OpRole.Loss: where the backward starts
            if p.loss_name in op.outputs:
                op.role = "loss"
    return p, chains


# Metadata is text a file's author controls: a parser given it may raise anything a parser
# raises, including RecursionError on deeply nested JSON or Python literals.
_PARSE_ERRORS = (ValueError, KeyError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError)
# metaopt writes stage numbers well under this; a larger one is tampering, not a pipeline.
_MAX_STAGE = 1 << 16


def _model_meta(key: str, text: str, parse, check):  # noqa: ANN001, ANN202
    """Parse one model-level metadata entry metaopt wrote; every failure is an ImportError_."""
    try:
        info = parse(text)
    except _PARSE_ERRORS as e:
        raise ImportError_(
            f"model metadata {key!r} is malformed ({type(e).__name__}: {e}): {text[:200]!r}"
        ) from None
    problem = check(info)
    if problem:
        raise ImportError_(f"model metadata {key!r}: {problem}: {text[:200]!r}")
    return info


def _check_pipeline(info: PipelineInfo) -> str | None:
    from metaopt.runtime.schedules import SCHEDULES

    if not 1 <= info.num_stages <= _MAX_STAGE:
        return f"num_stages={info.num_stages} is not in 1..{_MAX_STAGE}"
    if not 0 <= info.stage < info.num_stages:
        return f"stage={info.stage} is not in 0..{info.num_stages - 1}"
    for name in ("micro_batches", "chunks", "dp_degree"):
        if getattr(info, name) < 1:
            return f"{name}={getattr(info, name)} must be at least 1"
    if info.schedule not in SCHEDULES:
        return f"schedule {info.schedule!r} is not one of {', '.join(SCHEDULES)}"
    ranks = info.num_stages * info.dp_degree
    bad = [r for g in info.groups for r in g if not 0 <= r < ranks]
    if bad:
        return f"tied-param group rank {bad[0]} is not in 0..{ranks - 1}"
    return None


def _check_gradient_merge(info: GradientMergeInfo) -> str | None:
    if info.k_steps < 1:
        return f"k_steps={info.k_steps} must be at least 1"
    return None


def _check_saved_program(p: Program) -> None:
    """Cross-checks of what metadata names: op stages within the pipeline, the gradient-merge
    step counter exists. (The pipeline's loss is not checked: stages before the last do not
    hold it, by design.)"""
    if p.pipeline is not None:
        n_virtual = p.pipeline.num_stages * p.pipeline.chunks
        for op in p.ops:
            if op.stage is not None and op.stage >= n_virtual:
                raise ImportError_(
                    f"op {op.type} (outputs {op.outputs}): metadata stage {op.stage} is not a stage of "
                    f"this pipeline (0..{n_virtual - 1})"
                )
    gm = p.gradient_merge
    if gm is not None and (gm.step not in p.vars or not p.vars[gm.step].persistable):
        raise ImportError_(
            f"model metadata {onnx_save.GRADIENT_MERGE_KEY!r} names step counter {gm.step!r}, not an "
            "initializer of the graph"
        )


def _modules(text: str) -> dict[str, list[str]]:
    try:
        mods = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ImportError_(f"model metadata {onnx_save.MODULES_KEY!r} is not valid JSON: {e}") from None
    if not isinstance(mods, dict) or not all(isinstance(v, list) for v in mods.values()):
        raise ImportError_(
            f"model metadata {onnx_save.MODULES_KEY!r} must map module paths to lists of names"
        )
    return {str(k): [str(x) for x in v] for k, v in mods.items()}


def _derived(text: str, p: Program) -> frozenset[str]:
    try:
        names = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ImportError_(f"model metadata {onnx_save.DERIVED_KEY!r} is not valid JSON: {e}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ImportError_(f"model metadata {onnx_save.DERIVED_KEY!r} must be a list of names")
    unknown = [n for n in names if n not in p.vars or not p.vars[n].persistable]
    if unknown:
        raise ImportError_(
            f"model metadata {onnx_save.DERIVED_KEY!r} names {unknown[0]!r}, not an initializer of the graph"
        )
    return frozenset(names)


def _mixed_list(text: str) -> list:
    """A list attr of ints and symbolic dims (a Send/Recv shape), as metaopt saved it."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise ValueError(text) from None
    if not isinstance(value, list) or not all(isinstance(x, (int, str)) for x in value):
        raise ValueError(text)
    return value


def _drop_discarded(node: onnx.NodeProto, outputs: list[str]) -> list[str]:
    """Outputs metaopt named only because ONNX requires a name there (onnx_save): unnamed again."""
    key = onnx_save.DISCARDED_KEY
    raw = _meta(node).get(key)
    if raw is None:
        return outputs
    try:
        positions = {int(k) for k in raw.split(",")}
    except ValueError:
        raise ImportError_(f"{_describe(node)}: metadata {key!r} is {raw[:40]!r}") from None
    if not positions <= set(range(len(outputs))):
        raise ImportError_(f"{_describe(node)}: metadata {key!r} names no output: {raw[:40]!r}")
    return ["" if k in positions else o for k, o in enumerate(outputs)]


def _split_meta(name: str, value: str) -> Split:
    """Var.split of a file metaopt saved (onnx_save.SPLIT_KEY)."""
    try:
        d = json.loads(value)
        axis, parts, blocks = d["axis"], d["parts"], d["blocks"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (axis, parts, *blocks)):
            raise TypeError
        return Split(axis, parts, tuple(blocks))
    except (ValueError, TypeError, KeyError):
        raise ImportError_(
            f"initializer {name!r}: metadata {onnx_save.SPLIT_KEY!r} is {value[:80]!r}"
        ) from None


def _zero_meta(name: str, value: str) -> ZeroShard:
    """Var.zero of a file metaopt saved (onnx_save.ZERO_KEY)."""
    try:
        d = json.loads(value)
        parts, full = d["parts"], d["full"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (parts, *full)):
            raise TypeError
        return ZeroShard(parts, tuple(full))
    except (ValueError, TypeError, KeyError):
        raise ImportError_(
            f"initializer {name!r}: metadata {onnx_save.ZERO_KEY!r} is {value[:80]!r}"
        ) from None


def _extra_attr(node: onnx.NodeProto, key: str, value: str) -> Any:
    """An attr metaopt kept as metadata (onnx_save.EXTRA_ATTR_PREFIX): a JSON scalar or flat list."""
    try:
        v = json.loads(value)
    except ValueError:
        v = None
    scalar = (str, int, float, bool)
    if isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v)):
        return v
    raise ImportError_(f"{_describe(node)}: metadata {key!r} is not a JSON scalar or list: {value[:60]!r}")


def _restore_fields(op: Op, node: onnx.NodeProto) -> None:
    """Op fields of a file metaopt saved (role, stage, scope, origin)."""
    if not node.metadata_props:
        return
    m = _meta(node)
    for key, value in m.items():
        if key.startswith(onnx_save.EXTRA_ATTR_PREFIX):
            op.attrs[key[len(onnx_save.EXTRA_ATTR_PREFIX) :]] = _extra_attr(node, key, value)
        if key.startswith(onnx_save.ATTR_PREFIX) and key[len(onnx_save.ATTR_PREFIX) :] in op.attrs:
            try:
                exact = _mixed_list(value) if value.startswith("[") else float(value)
                op.attrs[key[len(onnx_save.ATTR_PREFIX) :]] = exact
            except ValueError:
                raise ImportError_(
                    f"{_describe(node)}: metadata {key!r} is not a float or a shape list: {value!r}"
                ) from None
    pre = onnx_save.OP_FIELD_PREFIX
    if pre + "role" in m:
        role = m[pre + "role"]
        if role not in ROLES:
            # Op refuses an unknown role at creation; this field is set after it, so check here.
            raise ImportError_(
                f"{_describe(node)}: metadata {pre + 'role'!r} is {role!r}, not an op role "
                f"(one of {', '.join(ROLES)}){did_you_mean(role, ROLES)}"
            )
        op.role = role
        op.scope = m.get(pre + "scope", op.scope)
        op.origin = m.get(pre + "origin")
        stage = m.get(pre + "stage")
        # Decimal digits only: int() would also take ' 1', '+1', '1_0' and a 4300-digit number.
        if stage is not None and not (
            stage.isascii() and stage.isdigit() and len(stage) <= 5 and int(stage) < _MAX_STAGE
        ):
            raise ImportError_(
                f"{_describe(node)}: metadata {pre + 'stage'!r} is {stage[:40]!r}, not a stage number "
                f"(0..{_MAX_STAGE - 1})"
            )
        op.stage = int(stage) if stage is not None else None


def _constant_value(node: onnx.NodeProto):
    import torch

    if len(node.attribute) != 1:
        raise ImportError_(f"{_describe(node)}: a Constant needs exactly one value attribute")
    a = node.attribute[0]
    v = attr_value(a)
    if a.name in ("value", "sparse_value"):
        if not isinstance(v, torch.Tensor):
            raise ImportError_(f"{_describe(node)}: sparse constants are not supported")
        return v
    dtype = {
        "value_float": torch.float32,
        "value_floats": torch.float32,
        "value_int": torch.int64,
        "value_ints": torch.int64,
    }.get(a.name)
    if dtype is None:
        raise ImportError_(f"{_describe(node)}: Constant attribute {a.name!r} is not supported")
    return torch.tensor(v, dtype=dtype)

"""`metaopt.export(module, args)`: torch.export, torch.onnx.export, then import as a training program.

The capture is ours (frontend/capture.py): a batch dim the code fixes is an error naming the
line (``dynamic_batch=False`` exports fixed on purpose), and repeated module calls are numbered
(``layer@1``). An exporter failure names the aten op, the module and the source line.

Export settings that matter for training (DESIGN.md, "Known traps"):
``dynamo=True, optimize=False`` keeps every parameter an initializer under its
state_dict name (the default optimization folds weights into constants and
merges equal initializers); a symbolic ``batch`` dim on dim 0 of every tensor
argument makes one program run any batch size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import warnings
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from metaopt import limits
from metaopt.frontend.capture import ExportError, capture, explain_failure
from metaopt.frontend.experts import grouped_experts
from metaopt.frontend.importer import import_model
from metaopt.frontend.onnx_import import ImportOptions
from metaopt.frontend.shape_probe import probe_shapes
from metaopt.host_memory import return_freed_host_memory
from metaopt.ir import Program, Var, dtype_name
from metaopt.progress import timed

BATCH = "batch"
_LOG = logging.getLogger("metaopt.export")  # each phase's seconds at INFO (metaopt.progress)


def export(
    module: torch.nn.Module,
    args: tuple | torch.Tensor,
    kwargs: dict[str, Any] | None = None,
    dynamic_batch: bool = True,
    *,
    name: str | None = None,
    channels_last: bool = True,
) -> Program:
    """Export `module` (whose forward returns the loss, or any outputs) to a Program.

    The module's mode decides the program's: in train mode Dropout stays random
    and BatchNorm uses batch statistics and updates its running stats. Feed
    names are forward's argument names. 2-D convolutions run channels-last unless
    `channels_last=False` (passes/channels_last.py).
    """
    if isinstance(args, torch.Tensor):
        args = (args,)
    kwargs = dict(kwargs or {})
    derived_buffers(module)
    if _on_meta(module):  # a module without values traces with example inputs without values
        args = tuple(_to_meta(a) for a in args)
        kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    dynamic_shapes = _batch_dims(module, args, kwargs) if dynamic_batch else None
    ep = None
    try:
        # The ONNX exporter re-traces the captured graph to decompose it, and a view recorded
        # after attention must stay valid there: SDPA's fake output layout has to be the same
        # in both traces, which only the math backend's (contiguous) is. (T5 and Swin failed
        # with "Cannot view a tensor with shape ... strides ..." otherwise.) ONNX has no layouts:
        # the program is the same whichever backend the trace saw.
        with sdpa_kernel([SDPBackend.MATH]), grouped_experts(module):
            with timed(_LOG, "export: torch.export capture"):
                ep = capture(module, args, kwargs, dynamic_shapes)
            if module.training:  # in-place and feature dropouts as Dropout (frontend/translations.py)
                ep = _dropout_forms(ep)
            with timed(_LOG, "export: torch.onnx decomposition"):
                onnx_program = _run_exporter(ep, args, kwargs, dynamic_shapes)
    except ExportError:
        raise
    except Exception as e:  # the exporters raise many types: name the op, module and line
        raise ExportError(explain_failure(module, ep, e)) from e
    opts = _options(module)
    bn = {
        n: m.momentum
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    }
    for path, m in bn.items():
        if m is None and module.training:
            raise NotImplementedError(
                f"BatchNorm {path!r} with momentum=None (cumulative average) in train mode"
            )
    shape_data = max(limits.active().max_shape_data, limits.EXPORT_SHAPE_DATA)  # never below the caller's
    exported = dataclasses.replace(limits.active(), max_shape_data=shape_data)
    with timed(_LOG, "export: import as a program"), limits.using(exported):
        opts.values = by_reference(onnx_program.model)
        program = import_model(
            _serialize(onnx_program.model),
            options=opts,
            training=module.training,
            bn_momentum=bn,
            name=name or type(module).__name__.lower(),
            channels_last=channels_last,
        )
    _add_unused_params(program, module, opts.values)
    _record_references(program, opts.values)
    program.derived = frozenset(n for n in _non_persistent(module) if n in program.vars)
    if dynamic_batch:
        probe_shapes(program, BATCH)
    del ep, onnx_program
    # the traces are garbage now: each worker keeps only the program (their size grows with depth)
    return_freed_host_memory(sum(v.nbytes() or 0 for v in program.params(trainable_only=False)))
    return program


def derived_buffers(module: torch.nn.Module) -> list[str]:
    """Give the meta module's *non-persistent* buffers their values: derived data (rotary
    frequency tables, position ids) that no checkpoint holds, so that a module built on the meta
    device exports with them. Each is made by the Hugging Face init of the nearest pretrained
    model above its module (``_init_weights``, as ``from_pretrained`` does after a meta build);
    one that init does not set stays on meta (a value must then come from elsewhere: the executor
    names it). Returns the buffers given values (the module's own, changed in place)."""
    from metaopt.frontend.module_init import hf_init, is_unset, sentinel

    parents = {path: m for path, m in module.named_modules()}
    done = []
    for path, sub in module.named_modules():
        names_ = [n for n in sub._non_persistent_buffers_set if getattr(sub, n, None) is not None]
        meta = [n for n in names_ if sub._buffers[n].is_meta]
        init = hf_init(path, parents) if meta else None
        if init is None:
            continue
        fills = {}
        for n in meta:
            b = sub._buffers[n]
            fills[n] = sentinel(b.dtype)
            sub._buffers[n] = torch.full(b.shape, fills[n], dtype=b.dtype)
        init(sub)
        for n, fill in fills.items():
            b = sub._buffers[n]
            if is_unset(b, fill):
                sub._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device="meta")
            else:
                done.append(f"{path}.{n}" if path else n)
    return done


def _non_persistent(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s non-persistent buffers (not in its state_dict)."""
    return [
        f"{path}.{n}" if path else n
        for path, sub in module.named_modules()
        for n in sub._non_persistent_buffers_set
        if sub._buffers.get(n) is not None
    ]


def _on_meta(module: torch.nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and all(p.is_meta for p in params)


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


# A floating initializer, one this large, or one on the meta device reaches the Program by
# reference; small integer ones (shape constants the import folds and reads) stay in the proto.
BY_REFERENCE_MIN_BYTES = 1024


def by_reference(model: Any) -> dict[str, torch.Tensor]:
    """Take the exporter's initializers that hold torch tensors (the module's own parameters and
    buffers: the exporter wraps them, it does not copy them) out of `model` (an onnx_ir Model),
    leaving each an external-data placeholder of its dtype and shape: `{name: tensor}`, for the
    import to take as they are. Serializing the values into a ModelProto would copy each several
    times over (the proto, onnx's shape inference, numpy, torch) and fails on the meta device."""
    import onnx_ir as ir

    values: dict[str, torch.Tensor] = {}
    for name, v in model.graph.initializers.items():
        raw = getattr(v.const_value, "raw", None)
        if not isinstance(raw, torch.Tensor):
            continue
        small = raw.numel() * raw.element_size() < BY_REFERENCE_MIN_BYTES
        if small and not raw.is_meta and not raw.is_floating_point():
            continue
        values[name] = raw.detach()
        v.const_value = ir.ExternalTensor(
            BY_REFERENCE_LOCATION, None, None, v.const_value.dtype, shape=v.const_value.shape, name=name
        )
    return values


BY_REFERENCE_LOCATION = "metaopt:by-reference"  # never a file: the import takes the value given


def _record_references(program: Program, values: dict[str, torch.Tensor]) -> None:
    """Note each value the program holds by reference with its version counter (`Program.referenced`)."""
    import weakref

    given = {id(t) for t in values.values()}
    for name, t in program.values.items():
        if id(t) in given:
            program.referenced[name] = (weakref.ref(t), t._version)


def _serialize(model: Any) -> Any:
    import onnx_ir as ir

    return ir.serde.serialize_model(model)


def _batch_dims(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    batch = torch.export.Dim(BATCH)
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    shapes: dict[str, Any] = {}
    for pname, value in bound.arguments.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            if value.shape[0] < 2:
                raise ExportError(
                    f"argument {pname!r} has batch size {value.shape[0]}: torch.export specializes "
                    "batch sizes 0 and 1; export with a batch of at least 2 (or dynamic_batch=False)"
                )
            shapes[pname] = {0: batch}
        else:
            shapes[pname] = None
    return shapes


def _run_exporter(ep: torch.export.ExportedProgram, args: tuple, kwargs: dict, dynamic_shapes: Any):
    # The exporter prints progress lines and warns about train mode; a training
    # export is intended here, and the progress belongs to torch, not our users.
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "torchvision is not installed" on every export
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return torch.onnx.export(
                ep,
                args,
                kwargs=kwargs or None,
                dynamo=True,
                optimize=False,
                dynamic_shapes=dynamic_shapes,  # names the ONNX dims ("batch", not torch's s77)
                verbose=False,
                report=False,
                custom_translation_table=_translation_table(),
            )
    finally:
        quiet.setLevel(level)


def _options(module: torch.nn.Module) -> ImportOptions:
    canonical = {id(p): n for n, p in module.named_parameters()}
    opts = ImportOptions(symbolic_dims={BATCH: BATCH})
    for sd_name, p in module.named_parameters(remove_duplicate=False):
        opts.rename[sd_name] = canonical[id(p)]
        opts.kinds[sd_name] = "param"
        if not p.requires_grad:
            opts.frozen.add(sd_name)
    for b_name, _ in module.named_buffers(remove_duplicate=False):
        opts.kinds[b_name] = "buffer"
    return opts


def _add_unused_params(program: Program, module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    # The exporter drops parameters the forward never reads; users still find
    # every named_parameters() entry (their grads are zero / absent).
    for n, p in module.named_parameters():
        if n not in program.vars:
            values[n] = p.detach()
            program.add_var(
                Var(n, dtype_name(p.dtype), tuple(p.shape), kind="param", trainable=p.requires_grad),
                values[n],  # by reference, as every other value (the executor copies into its scope)
            )
    program.sort_vars()  # among the params, as a saved program loads back


def _dropout_forms(ep):  # noqa: ANN001, ANN202
    from metaopt.frontend.translations import dropout_forms  # onnxscript: see _translation_table

    return dropout_forms(ep)


def _translation_table() -> dict:
    # onnxscript (the translations' language) takes about a second to import: only an export
    # needs it, not every process that imports metaopt (a worker that loads a saved program).
    from metaopt.frontend.translations import translation_table

    return translation_table()

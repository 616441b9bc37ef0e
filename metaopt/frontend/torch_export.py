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
import inspect
import io
import logging
import warnings
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from metaopt.frontend.capture import ExportError, capture, explain_failure
from metaopt.frontend.importer import import_model
from metaopt.frontend.onnx_import import ImportOptions
from metaopt.frontend.shape_probe import probe_shapes
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
    dynamic_shapes = _batch_dims(module, args, kwargs) if dynamic_batch else None
    ep = None
    try:
        # The ONNX exporter re-traces the captured graph to decompose it, and a view recorded
        # after attention must stay valid there: SDPA's fake output layout has to be the same
        # in both traces, which only the math backend's (contiguous) is. (T5 and Swin failed
        # with "Cannot view a tensor with shape ... strides ..." otherwise.) ONNX has no layouts:
        # the program is the same whichever backend the trace saw.
        with sdpa_kernel([SDPBackend.MATH]):
            with timed(_LOG, "export: torch.export capture"):
                ep = capture(module, args, kwargs, dynamic_shapes)
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
    with timed(_LOG, "export: import as a program"):
        program = import_model(
            onnx_program.model_proto,
            options=opts,
            training=module.training,
            bn_momentum=bn,
            name=name or type(module).__name__.lower(),
            channels_last=channels_last,
        )
    _add_unused_params(program, module)
    if dynamic_batch:
        probe_shapes(program, BATCH)
    return program


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


def _add_unused_params(program: Program, module: torch.nn.Module) -> None:
    # The exporter drops parameters the forward never reads; users still find
    # every named_parameters() entry (their grads are zero / absent).
    for n, p in module.named_parameters():
        if n not in program.vars:
            program.add_var(
                Var(n, dtype_name(p.dtype), tuple(p.shape), kind="param", trainable=p.requires_grad),
                p.detach().clone(),
            )
    program.sort_vars()  # among the params, as a saved program loads back


def _translation_table() -> dict:
    # onnxscript (the translations' language) takes about a second to import: only an export
    # needs it, not every process that imports metaopt (a worker that loads a saved program).
    from metaopt.frontend.translations import translation_table

    return translation_table()

"""The import pipeline: ONNX ModelProto -> a ready Program, steps in a fixed order."""

from __future__ import annotations

import os

import onnx

from metaopt.dump import dump
from metaopt.frontend.naming import readable_names
from metaopt.frontend.onnx_import import ImportError_, ImportOptions, to_program
from metaopt.frontend.repair import repair_training
from metaopt.frontend.safe_load import ModelLoadError, ModelNotSupported, load_model_proto
from metaopt.ir import Program, verify
from metaopt.ir.gc_pause import without_gc
from metaopt.limits import LoadLimits, using
from metaopt.passes.channels_last import channels_last as channels_last_convs
from metaopt.passes.dead_code import dead_code
from metaopt.passes.driver import verified
from metaopt.passes.fold_constants import ConstantTooLarge, fold_constants
from metaopt.passes.fuse import fuse


@without_gc  # a bulk build: see metaopt.ir.gc_pause
def import_model(
    model: onnx.ModelProto,
    *,
    options: ImportOptions | None = None,
    training: bool = False,
    bn_momentum: dict[str, float] | None = None,
    name: str = "main",
    channels_last: bool = True,
) -> Program:
    """raw import -> training repairs -> fold constants -> dead code -> fuse -> channels-last
    convolutions (unless `channels_last=False`) -> names, each step verified (a StepError
    names the one that broke an invariant; programs over `VERIFY_EACH_STEP_OPS` ops once, at
    the end) and dumped under ``METAOPT_DUMP``.

    Names are rewritten only for torch exports (recognised by their module-scope
    metadata); any other file keeps the names its author chose.
    """
    p, chains = to_program(model, options, name=name)
    each = len(p.ops) <= VERIFY_EACH_STEP_OPS
    if each:  # what the file itself holds: an invariant broken here is the file's, not a step's
        try:
            verify(p)
        except ValueError as e:
            raise ImportError_(f"the file's graph is not a valid program: {e}") from None
    dump(p, "import")
    if training:
        repair_training(p, bn_momentum=bn_momentum or {})
        _after(p, "repair_training", each)
    for step in (fold_constants, dead_code, fuse, *([channels_last_convs] if channels_last else [])):
        q = step(p)
        if q is not p:
            _drop(p)
        p = q
        _after(p, step.__name__, each)
    if any(chains.values()):  # a torch export: its FX names mean nothing to users
        readable_names(p, chains)
    p.sort_vars()
    _after(p, "readable_names", True)
    return p


# Up to this many ops every import step is verified, so an invariant broken is named by the step
# that broke it; a larger program is verified once, at the end (a verify costs 0.12 s at 100k
# ops here: six of them would add a quarter to benchmarks/load_100k.py's 2.4 s load).
VERIFY_EACH_STEP_OPS = 20_000


def _after(p: Program, step: str, check: bool) -> None:
    if check:
        verified(p, step)
    dump(p, step)


@without_gc
def load(
    source: str | os.PathLike | bytes | onnx.ModelProto,
    *,
    training: bool = False,
    name: str | None = None,
    limits: LoadLimits | None = None,
    channels_last: bool = True,
) -> Program:
    """Import any ONNX model (file path, bytes or ModelProto), validated as untrusted input.

    Floating initializers become trainable params unless the file's torch export
    metadata says buffer; integer ones become constants. `training=True` applies
    the train-mode repairs (Dropout on, BatchNorm with batch statistics).
    `limits` bounds what the file may make us allocate (default `metaopt.limits.LIMITS`);
    a file over them fails with ModelLoadError naming the tensor or op and the size.
    `channels_last=False` leaves 2-D convolutions in torch's default layout
    (passes/channels_last.py).
    """
    with using(limits) as active:
        model = load_model_proto(source, limits=active)
        if name is None:
            name = model.graph.name or "main"
        label = _label(source)
        try:
            return import_model(model, training=training, name=name, channels_last=channels_last)
        except ConstantTooLarge as e:
            raise ModelLoadError(f"{label}: {e}") from None
        except ImportError_ as e:
            # Errors about the file's contents name the file too (a user loading several
            # files, or a file from a pipeline stage, needs to know which one).
            raise ImportError_(f"{label}: {e}") from None
        except ModelLoadError:
            raise
        except NotImplementedError as e:  # a feature of the file we do not support (a dtype ...)
            raise ModelNotSupported(f"{label}: {e}") from e
        except Exception as e:  # noqa: BLE001 - the file is untrusted: whatever it breaks names it
            # Every check we know of raises one of the above; this is the net under them (a
            # fuzzed file found a VerifyError and a TypeError here), the cause kept for a report.
            raise ModelLoadError(f"{label}: {type(e).__name__}: {e}") from e


def _drop(p: Program) -> None:
    """Let a program this import made, and nothing else holds, go at once: its vars point
    back at it (`Var.program`), a cycle only the garbage collector frees, and the collector
    is paused during the import (100k ops: 2M objects piled up, then 0.7 s to collect)."""
    p.vars = {}


def _label(source: str | os.PathLike | bytes | onnx.ModelProto) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fsdecode(os.fspath(source))
    return "<ModelProto>" if isinstance(source, onnx.ModelProto) else "<bytes>"

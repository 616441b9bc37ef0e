"""The import pipeline: ONNX ModelProto -> a ready Program, `IMPORT_STEPS` in order, one driver."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

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
from metaopt.passes.driver import Run, Step, check_declarations, run_steps
from metaopt.passes.fold_constants import ConstantTooLarge, fold_constants
from metaopt.passes.fuse import fuse
from metaopt.passes.pipeline_phases import pipeline_phases


@dataclass
class ImportRun(Run):
    """What the import steps read: the caller's options and what the raw import found."""

    training: bool = False
    bn_momentum: dict[str, float] = field(default_factory=dict)
    channels_last: bool = True
    chains: dict = field(default_factory=dict)  # the raw import's FX-name chains (torch exports)
    stage_program: bool = False  # the file holds a pipeline stage program


def _on(flag: str) -> Callable[[ImportRun], tuple[bool, str]]:
    return lambda run: (bool(getattr(run, flag)), f"{flag}={getattr(run, flag)}")


def _always(run: ImportRun) -> tuple[bool, str]:
    return True, "every import"


def _torch_export(run: ImportRun) -> tuple[bool, str]:
    on = any(run.chains.values())  # a torch export: its FX names mean nothing to users
    return on, "a torch export (module-scope metadata)" if on else "names as the file's author chose"


def _in_place(edit: Callable[[Program, ImportRun], object]) -> Callable[[Program, None, ImportRun], Program]:
    """A step that edits the importer's own program in place (`run_steps(owned=True)`)."""

    def rewrite(p: Program, plan: None, run: ImportRun) -> Program:
        edit(p, run)
        return p

    return rewrite


_repair = _in_place(lambda p, run: repair_training(p, bn_momentum=run.bn_momentum))
_names = _in_place(lambda p, run: readable_names(p, run.chains))
_sorted = _in_place(lambda p, run: p.sort_vars())


def _pure(rewrite: Callable[[Program], Program]) -> Callable[[Program, None, ImportRun], Program]:
    return lambda p, plan, run: rewrite(p)


IMPORT_STEPS = (
    Step(
        "repair_training",
        _on("training"),
        _repair,
        doc="Dropout on, BatchNorm with batch statistics",
        reads=("training", "bn_momentum"),
    ),
    Step(
        "fold_constants", _always, _pure(fold_constants), doc="static shape arithmetic and constants folded"
    ),
    Step("dead_code", _always, _pure(dead_code), doc="ops nothing reads dropped"),
    Step("fuse", _always, _pure(fuse), doc="the op table's fusions"),
    Step(
        "channels_last",
        _on("channels_last"),
        _pure(channels_last_convs),
        doc="2-D convolutions channels-last",
        reads=("channels_last",),
    ),
    Step("readable_names", _torch_export, _names, doc="FX names replaced by module paths", reads=("chains",)),
    Step("sort_vars", _always, _sorted, doc="vars in a stable order"),
    Step(
        "pipeline_phases",
        _on("stage_program"),
        _pure(pipeline_phases),
        doc="a saved pipeline stage program cut into its phases",
        reads=("stage_program",),
    ),
)
check_declarations(
    IMPORT_STEPS,
    ImportRun,
    frozenset({"training", "bn_momentum", "channels_last", "chains", "stage_program"}),
)


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
    """The raw import, then `IMPORT_STEPS` through the one driver (passes/driver.py): training
    repairs, fold constants, dead code, fuse, channels-last convolutions (unless
    `channels_last=False`), readable names, and a saved pipeline stage program's phases; each
    step verified (a StepError names the one that broke an invariant; programs over
    `VERIFY_EACH_STEP_OPS` ops once, at the end) and dumped under ``METAOPT_DUMP``.

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
    run = ImportRun(
        training=training,
        bn_momentum=bn_momentum or {},
        channels_last=channels_last,
        chains=chains,
        stage_program=p.pipeline is not None,
    )
    return run_steps(p, IMPORT_STEPS, run, owned=True, verify_each=each, label="import")


# Up to this many ops every import step is verified, so an invariant broken is named by the step
# that broke it; a larger program is verified once, at the end (a verify costs 0.12 s at 100k
# ops here: six of them would add a quarter to benchmarks/load_100k.py's 2.4 s load).
VERIFY_EACH_STEP_OPS = 20_000


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


def _label(source: str | os.PathLike | bytes | onnx.ModelProto) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fsdecode(os.fspath(source))
    return "<ModelProto>" if isinstance(source, onnx.ModelProto) else "<bytes>"

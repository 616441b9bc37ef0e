"""The import pipeline: ONNX ModelProto -> a ready Program, steps in a fixed order."""

from __future__ import annotations

import os

import onnx

from metaopt.dump import dump
from metaopt.frontend.naming import readable_names
from metaopt.frontend.onnx_import import ImportOptions, to_program
from metaopt.frontend.repair import repair_training
from metaopt.frontend.safe_load import load_model_proto
from metaopt.ir import Program, verify
from metaopt.passes.dead_code import dead_code
from metaopt.passes.fold_constants import fold_constants
from metaopt.passes.fuse_linear import fuse_linear

_KIND_ORDER = {"input": 0, "param": 1, "buffer": 2, "opt_state": 3, "constant": 4}


def import_model(
    model: onnx.ModelProto,
    *,
    options: ImportOptions | None = None,
    training: bool = False,
    bn_momentum: dict[str, float] | None = None,
    name: str = "main",
) -> Program:
    """raw import -> training repairs -> fold constants -> dead code -> fuse Linear -> names -> verify.

    Names are rewritten only for torch exports (recognised by their module-scope
    metadata); any other file keeps the names its author chose.
    """
    p, chains = to_program(model, options, name=name)
    dump(p, "import")
    if training:
        repair_training(p, bn_momentum=bn_momentum or {})
        dump(p, "repair_training")
    for step in (fold_constants, dead_code, fuse_linear):
        p = step(p)
        dump(p, step.__name__)
    if any(chains.values()):  # a torch export: its FX names mean nothing to users
        readable_names(p, chains)
    _order_vars(p)
    dump(p, "readable_names")
    verify(p)
    return p


def _order_vars(p: Program) -> None:
    # Inputs, params, buffers, constants, then activations in program order: the
    # printed program reads top-down.
    first_use = {o: i for i, op in reversed(list(enumerate(p.ops))) for o in op.outputs}
    order = sorted(
        p.vars.values(),
        key=lambda v: (
            _KIND_ORDER.get(v.kind, 5),
            first_use.get(v.name, -1) if v.kind == "activation" else 0,
        ),
    )
    p.vars = {v.name: v for v in order}


def load(
    source: str | os.PathLike | bytes | onnx.ModelProto, *, training: bool = False, name: str | None = None
) -> Program:
    """Import any ONNX model (file path, bytes or ModelProto), validated as untrusted input.

    Floating initializers become trainable params unless the file's torch export
    metadata says buffer; integer ones become constants. `training=True` applies
    the train-mode repairs (Dropout on, BatchNorm with batch statistics).
    """
    model = load_model_proto(source)
    if name is None:
        name = model.graph.name or "main"
    return import_model(model, training=training, name=name)

"""Training-mode repairs of torch 2.13 exports (DESIGN.md, "Known traps").

Which op needs which repair is its op-table row's ``train_repair`` (ops/registry.py):

* ``training_mode_input`` (Dropout): `scaled_dot_product_attention`'s probability
  dropout is exported as a 2-input Dropout (inference semantics); every Dropout of a
  module exported in train mode gets ``training_mode=True`` (ONNX's input 2).
* ``batch_norm_training`` (BatchNormalization): exported with inference semantics. In
  train mode it becomes our ``BatchNormTraining`` (torch semantics: batch statistics,
  running stats updated with the unbiased variance and torch's momentum), and the new
  running stats are written back through ``Program.updates``.
"""

from __future__ import annotations

import torch

from metaopt.ir import Op, Program, Var, names
from metaopt.ops import registry


def repair_training(p: Program, *, bn_momentum: dict[str, float]) -> None:
    """Rewrite in place (import time only). `bn_momentum`: module path -> torch momentum."""
    true_name = None
    for i, op in enumerate(p.ops):
        row = registry.get(op.type)
        repair = row.train_repair if row is not None else None
        if repair == "training_mode_input":
            if true_name is None:
                true_name = names.fresh("training_mode", p.vars)
                p.add_var(Var(true_name, "bool", (), kind="constant"), torch.tensor(True))
            ins = op.inputs + [""] * (3 - len(op.inputs))
            ins[2] = true_name
            op.inputs = ins
        elif repair == "batch_norm_training" and not op.attrs.get("training_mode", 0):
            p.ops[i] = _bn_training(p, op, bn_momentum)


def _bn_training(p: Program, op: Op, bn_momentum: dict[str, float]) -> Op:
    if len(op.inputs) != 5:
        raise ValueError(f"BatchNormalization in {op.scope!r} has {len(op.inputs)} inputs, expected 5")
    x, scale, bias, mean, var = op.inputs
    for stat in (mean, var):
        if p.vars[stat].kind != "buffer":
            raise ValueError(f"BatchNormalization in {op.scope!r}: running stat {stat!r} is not a buffer")
    # ONNX momentum weighs the old value; torch's weighs the new batch statistic.
    momentum = bn_momentum.get(op.scope, 1.0 - op.attrs.get("momentum", 0.9))
    outs = [op.outputs[0]]
    for stat in (mean, var):
        new = names.fresh(names.new_state(stat), p.vars)
        p.add_var(Var(new, p.vars[stat].dtype, p.vars[stat].shape))
        p.updates[stat] = new
        outs.append(new)
    attrs = {"epsilon": op.attrs.get("epsilon", 1e-5), "momentum": momentum}
    return Op("BatchNormTraining", [x, scale, bias, mean, var], outs, attrs, role=op.role, scope=op.scope)

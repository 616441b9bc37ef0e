"""master_weights (AMP O2, ``amp_configs['use_pure_fp16']``): float32 master copies of params.

Each update of a float16/bfloat16 param updates a persistable float32 ``w@MASTER`` (and
float32 optimizer state) from a float32 grad, and ``w@NEW = Cast(w@MASTER@NEW)`` writes the
low-precision param back. Pure: returns a rewritten copy.
"""

from __future__ import annotations

import torch

from metaopt.ir import TORCH_TO_ONNX, Op, Program, Var, names, torch_dtype
from metaopt.ops import registry
from metaopt.passes.amp import LOW_DTYPES, AmpError


def master_weights(program: Program) -> Program:
    """AMP O2: each update of a low-precision param updates its float32 master copy instead.

    For a param ``w`` stored in float16/bfloat16 the update op reads and writes the
    persistable float32 ``w@MASTER`` and float32 optimizer state, from a float32 grad
    (the unscaled grads already are; else a cast is added), and ``w@NEW = Cast(w@MASTER@NEW)``
    writes the low-precision param back. The master's initial value is the low-precision
    initial value widened (as apex's O2 makes its masters from the half model): every
    data-parallel worker then starts from the same masters, those of rank 0's broadcast
    params.
    """
    q = program.clone()
    out: list[Op] = []
    casts: dict[str, str] = {}
    for op in q.ops:
        param = op.origin
        pv = q.vars.get(param) if param else None
        is_param_update = registry.is_update(op.type) and op.role == "optimize"
        if not (is_param_update and pv is not None and pv.kind == "param"):
            if op.role == "optimize" and op.inputs and all(_f32(q, x) for x in op.inputs if _float(q, x)):
                for o in op.outputs:  # e.g. ClipByGlobalNorm of the float32 unscaled grads
                    if o and q.vars[o].kind == "grad" and q.vars[o].dtype in LOW_DTYPES:
                        q.vars[o].dtype = "float32"
            out.append(op)
            continue
        if pv.dtype == "float32":
            out.append(op)
            continue
        if param not in q.values:
            raise AmpError(f"use_pure_fp16: param {param!r} has no initial value for its master copy")
        low = pv.dtype
        master = names.master(param)
        # a tensor-parallel param's master copy is split as the param is (checkpoints save it by part)
        q.add_var(
            Var(master, "float32", pv.shape, "opt_state", split=pv.split), q.values[param].to(torch.float32)
        )
        grad = op.inputs[1]
        if q.vars[grad].dtype != "float32":
            if grad not in casts:
                c = names.fresh(names.cast(grad, "float32"), q.vars)
                q.add_var(Var(c, "float32", q.vars[grad].shape, "grad"))
                out.append(Op("Cast", [grad], [c], {"to": 1}, role="optimize", origin=grad))
                casts[grad] = c
            grad = casts[grad]
        state_in = [x for x in op.inputs[4:] if x and q.vars[x].kind == "opt_state"]
        for s in state_in + [o for o in op.outputs[1:] if o]:
            v = q.vars[s]
            if v.dtype == low:
                v.dtype = "float32"
                if s in q.values:
                    q.values[s] = q.values[s].to(torch.float32)
        new_low = op.outputs[0]
        new_master = names.new_state(master)
        q.add_var(Var(new_master, "float32", pv.shape))
        op.inputs = [master, grad, *op.inputs[2:]]
        op.outputs = [new_master, *op.outputs[1:]]
        q.updates[master] = new_master
        out.append(op)
        to = {"to": _onnx(low)}
        out.append(Op("Cast", [new_master], [new_low], to, role="optimize", origin=param))
    q.ops = out
    return q


def _float(q: Program, x: str) -> bool:
    return bool(x) and torch_dtype(q.vars[x].dtype).is_floating_point


def _f32(q: Program, x: str) -> bool:
    return q.vars[x].dtype == "float32"


def _onnx(dtype: str) -> int:
    return TORCH_TO_ONNX[torch_dtype(dtype)]

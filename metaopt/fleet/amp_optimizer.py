"""The AMP meta optimizer: Fleet's AMPOptimizer (Paddle's ``amp.decorate``) on metaopt's passes.

It is the OUTERMOST wrapper (``META_OPTIMIZERS``), so its ``minimize``:

1. rewrites a copy of the forward with `metaopt.passes.amp.amp` (casts around white-listed
   ops, black-listed ops in float32, shared casts; the loss stays float32);
2. with loss scaling (float16: on; bfloat16: off, its exponent range is float32's),
   adds the persistable ``loss_scaling`` and ``loss@SCALED`` (`scale_loss`);
3. lets the inner chain (recompute, data parallel, the optimizer) build the backward
   and the updates from that copy, starting from ``loss@SCALED``: recompute segments
   re-emit the casts with the rest of the segment, offloaded checkpoints are the
   low-precision vars;
4. inserts, after any all-reduce and before the optimizer ops, the fused
   ``CheckFiniteAndUnscale`` and Fleet's ``UpdateLossScaling``, rewires the optimizer
   to the unscaled grads and makes every update skip a step with inf/nan grads
   (`unscale_grads`); data-parallel workers check the same all-reduced grads, so they
   skip the same steps; on a pipeline stage (the inner chain returned this worker's
   stage program) the overflow flag is summed over the workers, so all stages skip the
   same steps;
5. with ``use_pure_fp16`` (O2) the params are stored in the low dtype and each update
   op updates a float32 master copy ``w@MASTER`` (persistable, with float32 optimizer
   state) from the float32 unscaled grad, then casts it back into ``w``;

and only then replaces the user's program, so a refused configuration leaves it
untouched. ``amp_plan`` (printable) says which op runs in which precision and why.

The returned ``params_grads`` name the grads the optimizer reads (the unscaled ones).
bfloat16 without loss scaling has no overflow check: a step with inf/nan grads is
applied, as in torch's bf16 autocast without a GradScaler. ``AmpOptimizer(...,
loss_scaling=True)`` turns scaling on for bfloat16 too.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from metaopt.dump import dump
from metaopt.fleet import env
from metaopt.ir import Op, Program, Var, names, torch_dtype
from metaopt.ops.kernels.amp import check_amp_device
from metaopt.ops.kernels.optim import SKIP_INPUT
from metaopt.passes.amp import (
    LOW_DTYPES,
    AmpError,
    AmpPlan,
    amp,
    check_op_types,
    plan_amp,
    scale_loss,
    unscale_grads,
)

logger = logging.getLogger("metaopt.fleet")


class AmpOptimizer:
    def __init__(self, inner: Any, configs: Any, *, loss_scaling: bool | None = None) -> None:
        self.inner = inner
        self.dtype = configs["dtype"]
        white, black = configs["custom_white_list"], configs["custom_black_list"]
        self.custom_white_list = check_op_types("amp_configs['custom_white_list']", white)
        self.custom_black_list = check_op_types("amp_configs['custom_black_list']", black)
        both = sorted(set(self.custom_white_list) & set(self.custom_black_list))
        if both:
            raise AmpError(
                f"op type {both[0]!r} is in both amp_configs['custom_white_list'] and ['custom_black_list']"
            )
        self.custom_black_varnames = list(configs["custom_black_varnames"])
        self.use_pure_fp16 = bool(configs["use_pure_fp16"])
        if self.use_pure_fp16 and configs["use_fp16_guard"]:
            raise AmpError(
                "amp_configs['use_pure_fp16']=True with use_fp16_guard=True runs only the ops inside "
                "fp16_guard regions in low precision, and an exported program has none: set "
                "amp_configs['use_fp16_guard'] = False (every op but the black list in low precision)"
            )
        self.loss_scaling = (self.dtype == "float16") if loss_scaling is None else bool(loss_scaling)
        self.scaling = {
            "use_dynamic_loss_scaling": bool(configs["use_dynamic_loss_scaling"]),
            "incr_every_n_steps": configs["incr_every_n_steps"],
            "decr_every_n_nan_or_inf": configs["decr_every_n_nan_or_inf"],
            "incr_ratio": configs["incr_ratio"],
            "decr_ratio": configs["decr_ratio"],
        }
        self.init_loss_scaling = configs["init_loss_scaling"]
        self.amp_plan: AmpPlan | None = None

    def _how(self) -> dict:
        return {
            "dtype": self.dtype,
            "custom_white_list": self.custom_white_list,
            "custom_black_list": self.custom_black_list,
            "custom_black_varnames": self.custom_black_varnames,
            "use_pure_fp16": self.use_pure_fp16,
        }

    def minimize(
        self, loss: Var, startup_program: Any = None, parameter_list: Any = None, no_grad_set: Any = None
    ) -> tuple[list, list]:
        program = loss.program
        # The device this worker trains on, by fleet's convention (as data parallel's broadcast):
        # refused here, before anything is rewritten; the program's first op checks the
        # executor's actual device again when it runs.
        cuda = torch.cuda.is_available()
        check_amp_device(self.dtype, torch.device("cuda", env.local_rank()) if cuda else torch.device("cpu"))
        self.amp_plan = plan_amp(program, **self._how())
        work = amp(program, **self._how())
        dump(work, "amp")
        target = loss.name
        if self.loss_scaling:
            work = scale_loss(work, init_loss_scaling=self.init_loss_scaling)
            target = names.scaled(loss.name)
        _, params_grads = self.inner.minimize(work.var(target), startup_program, parameter_list, no_grad_set)
        pairs = [tuple(x.name if isinstance(x, Var) else x for x in pair) for pair in params_grads]
        final = work
        master = "float32" if self.use_pure_fp16 else None
        if self.loss_scaling:
            # a pipeline stage (the inner chain split the program): its stages agree on skips
            stage = getattr(final, "pipeline", None) is not None
            final = unscale_grads(
                final,
                **self.scaling,
                master_dtype=master,
                across_workers=stage,
                init_loss_scaling=self.init_loss_scaling,
            )
            dump(final, "amp_unscale")
        if self.use_pure_fp16:
            final = master_weights(final)
            dump(final, "amp_master_weights")
        logger.info("%s", self.amp_plan)
        program.replace_with(final)
        read = _grads_read(program, pairs)
        optimize_ops = [op for op in program.ops if op.role == "optimize"]
        return optimize_ops, [(p, read.get(g, g)) for p, g in pairs]


def _grads_read(p: Program, pairs: list[tuple[str, str]]) -> dict[str, str]:
    """grad -> the grad var the update of its param reads (the unscaled one under loss scaling)."""
    by_param = {op.origin: op for op in p.ops if op.type in SKIP_INPUT and op.role == "optimize"}
    out = {}
    for param, grad in pairs:
        op = by_param.get(param)
        if op is not None and len(op.inputs) > 1:
            out[grad] = op.inputs[1]
    return out


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
        if not (op.type in SKIP_INPUT and op.role == "optimize" and pv is not None and pv.kind == "param"):
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
        q.add_var(Var(master, "float32", pv.shape, "opt_state"), q.values[param].to(torch.float32))
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
    from metaopt.frontend.attrs import TORCH_TO_ONNX

    return TORCH_TO_ONNX[torch_dtype(dtype)]

"""append_backward: the reverse walk that appends gradient ops (Fleet/Paddle semantics).

    program, params_grads = append_backward(program, loss="loss")

* Which vars get a grad: those that depend on a differentiated param (float dtypes
  only: integer and boolean paths carry no grad) and that the loss depends on.
* Each op's rule (its row's `grad`, see ops/grads.py) emits backward ops; an op
  without a rule uses the generic `Vjp` (autograd on its own kernel); a random op
  without a rule is an error naming its printed line.
* A var read by several ops gets one contribution per reader (``x@GRAD@1`` ...),
  summed explicitly into ``x@GRAD`` once its producer is reached (``GradAccumulate``
  adds into a contribution that is new storage nothing else reads, as torch's
  AccumulateGrad does; else ``GradSum`` into a fresh buffer); a single contribution
  is just renamed ``x@GRAD``.
* Backward ops have role=backward, the forward op's scope, and origin = the
  forward var whose grad they compute.

The pass is pure: the input program is not modified.
"""

from __future__ import annotations

from typing import Any

import torch

from metaopt.ir import TORCH_TO_ONNX, Op, Program, Var, did_you_mean, names, torch_dtype
from metaopt.ir.printer import fmt_op
from metaopt.ops import registry

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


class BackwardError(ValueError):
    pass


class GradBuilder:
    """What a gradient rule sees: the program being built and helpers to emit into it."""

    def __init__(self, bw: _Backward, op: Op) -> None:
        self._bw = bw
        self.op = op
        self.program = bw.q

    # --- questions ------------------------------------------------------------
    def needs(self, i: int) -> bool:
        """Does input i of the current op need a grad?"""
        x = self.op.inputs[i] if i < len(self.op.inputs) else ""
        return bool(x) and x in self._bw.wanted

    def var(self, name: str) -> Var:
        return self.program.vars[name]

    def shape(self, name: str) -> tuple:
        return self.program.vars[name].shape or ()

    def dtype(self, name: str) -> str:
        return self.program.vars[name].dtype

    def onnx_dtype(self, name: str) -> int:
        return TORCH_TO_ONNX[torch_dtype(self.dtype(name))]

    def constant_value(self, name: str) -> Any:
        v = self.program.values.get(name)
        return None if v is None or self.var(name).kind != "constant" else v.item() if v.numel() == 1 else v

    # --- making vars and ops ----------------------------------------------------
    def contrib(self, x: str) -> str:
        """A fresh grad-contribution var for forward var `x` (x's shape and dtype)."""
        return self._bw.new_contrib(x) if x else ""

    def contribs(self, n: int | None = None) -> tuple[list[str], list[int]]:
        """Contribution vars for the first `n` inputs of the op ("" where no grad is needed)
        and the matching `mask` attribute for grad kernels that can skip an output."""
        n = len(self.op.inputs) if n is None else n
        outs = [self.contrib(self.op.inputs[i]) if self.needs(i) else "" for i in range(n)]
        return outs, [int(bool(o)) for o in outs]

    def temp(self, like: str, shape: tuple | None = None, dtype: str | None = None) -> str:
        """A fresh grad-kind var shaped like `like` (or `shape`), for a rule's intermediate."""
        v = self.program.vars[like]
        name = names.fresh(names.grad_temp(self.op.outputs[0]), self.program.vars)
        self.program.add_var(Var(name, dtype or v.dtype, v.shape if shape is None else shape, kind="grad"))
        return name

    def const(self, value: Any, dtype: str) -> str:
        return self._bw.const(value, dtype)

    def emit(self, type: str, inputs: list[str], outputs: list[str], **attrs: Any) -> list[str]:
        op = Op(
            type,
            list(inputs),
            list(outputs),
            attrs,
            role="backward",
            scope=self.op.scope,
            origin=self.op.outputs[0],
        )
        self._bw.append(op)
        return list(outputs)

    def emit1(self, type: str, inputs: list[str], *, like: str, **attrs: Any) -> str:
        """One op with one output shaped like `like`; returns the output's name."""
        out = self.temp(like)
        self.emit(type, inputs, [out], **attrs)
        return out

    # --- common shapes of rules ---------------------------------------------------
    def unbroadcast(self, grad: str, x: str) -> str:
        """Sum `grad` (shaped like the op's output) down to x's shape (ONNX broadcasting)."""
        gs, xs = self.shape(grad), self.shape(x)
        lead = len(gs) - len(xs)
        lead_axes = list(range(lead))
        keep_axes = [lead + i for i, (d, s) in enumerate(zip(xs, gs[lead:])) if d == 1 and s != 1]
        out = grad
        if keep_axes:
            shape = tuple(1 if i in keep_axes else d for i, d in enumerate(gs))
            out = self.temp(grad, shape=shape)
            self.emit("ReduceSum", [grad, self.const(keep_axes, "int64")], [out], keepdims=1)
        if lead_axes:
            prev, out = out, self.temp(x)
            self.emit("ReduceSum", [prev, self.const(lead_axes, "int64")], [out], keepdims=0)
        if out == grad:
            return grad
        return out

    def reshape_like(self, grad: str, x: str) -> str:
        """Reshape `grad` to x's shape (one symbolic dim becomes -1)."""
        xs = self.shape(x)
        sym = [i for i, d in enumerate(xs) if not isinstance(d, int)]
        if len(sym) > 1:
            raise BackwardError(f"cannot reshape a grad to {list(xs)}: more than one symbolic dim")
        target = [-1 if i in sym else d for i, d in enumerate(xs)]
        return self.emit1("Reshape", [grad, self.const(target, "int64")], like=x)

    def saved_outputs(self, op: Op, what: list[tuple], count: int) -> list[str]:
        """Make forward `op` also produce its optional outputs up to index count-1, kept
        for the backward (dropout masks, norm statistics, log-probabilities). `what`
        gives (tag, shape, dtype) of the last len(what) of them, or (tag, shape, dtype,
        device) for one only that kind of device makes (`Var.device`); returns their names."""
        while len(op.outputs) < count:
            op.outputs.append("")
        out = []
        for k, (tag, shape, dtype, *device) in zip(range(count - len(what), count), what):
            if not op.outputs[k]:
                name = names.fresh(names.saved(op.outputs[0], tag), self.program.vars)
                self.program.add_var(Var(name, dtype, shape, device=device[0] if device else None))
                op.outputs[k] = name
            out.append(op.outputs[k])
        return out

    def vjp(self, op: Op, dy: list[str | None]) -> list[str | None]:
        """The generic rule: autograd on the op's own kernel."""
        row = registry.get(op.type)
        if row is None:
            raise BackwardError(f"op type {op.type} has no kernel, so no gradient: {fmt_op(op)}")
        if row.random:
            raise BackwardError(
                f"no gradient rule for random op {op.type} (re-running it would draw new random "
                f"numbers): {fmt_op(op)}"
            )
        wrt = [i for i in range(len(op.inputs)) if self.needs(i)]
        douts = [d if d else "" for d in dy]
        outs = [self.contrib(op.inputs[i]) for i in wrt]
        fwd = {f"f_{k}": v for k, v in op.attrs.items()}
        self.emit(
            "Vjp",
            [*op.inputs, *douts],
            outs,
            op=op.type,
            n_in=len(op.inputs),
            wrt=wrt,
            n_out=len(op.outputs),
            **fwd,
        )
        result: list[str | None] = [None] * len(op.inputs)
        for i, o in zip(wrt, outs):
            result[i] = o
        return result


class _Backward:
    def __init__(self, q: Program) -> None:
        self.q = q
        self.emitted: list[Op] = []
        self.made: set[str] = set()  # produced by an op of this pass
        self.producer_of: dict[str, Op] = {}
        self.reads: dict[str, int] = {}  # how many emitted ops read each var
        self.registered: dict[str, int] = {}  # how many forward vars a grad var contributes to
        self.contribs: dict[str, list[str]] = {}
        self.wanted: set[str] = set()
        self._consts: dict[tuple, str] = {}

    def append(self, op: Op) -> None:
        self.emitted.append(op)
        self.made.update(o for o in op.outputs if o)
        self.producer_of.update((o, op) for o in op.outputs if o)
        for i in op.inputs:
            if i:
                self.reads[i] = self.reads.get(i, 0) + 1

    def new_contrib(self, x: str) -> str:
        k = len(self.contribs.setdefault(x, [])) + 1
        name = names.fresh(names.grad_part(x, k), self.q.vars)
        v = self.q.vars[x]
        self.q.add_var(Var(name, v.dtype, v.shape, kind="grad"))
        return name

    def _owned(self, part: str) -> bool:
        """Made by this pass, a contribution to one var only, read by no emitted op."""
        return part in self.made and self.registered.get(part) == 1 and not self.reads.get(part)

    def _rename_owned(self, old: str, new: str) -> None:
        """Rename an owned contribution (`_owned`: no emitted op reads it): only its producer
        names it, so only that op changes (a scan of every emitted op per grad was quadratic).
        `made` and `producer_of` keep the old name, as the scan left them: the new name is a
        finished grad, not a fresh contribution to rename or add into again."""
        v = self.q.vars.pop(old)
        v.name = new
        self.q.vars[new] = v
        op = self.producer_of[old]
        op.outputs = [new if o == old else o for o in op.outputs]

    def _fresh(self, part: str) -> bool:
        """Its producer's outputs are new storage (not a view that may share a buffer)."""
        op = self.producer_of.get(part)
        row = registry.get(op.type) if op is not None else None
        return row is not None and row.fresh_outputs

    def register(self, x: str, contrib: str | None) -> None:
        if contrib:
            self.contribs.setdefault(x, [])
            # The same tensor may arrive twice (Add(x, x) passes dy to both inputs):
            # every arrival counts, and such a part is shared, never accumulated into.
            self.contribs[x].append(contrib)
            self.registered[contrib] = self.registered.get(contrib, 0) + 1

    def const(self, value: Any, dtype: str) -> str:
        key = (repr(value), dtype)
        if key not in self._consts:
            t = torch.tensor(value, dtype=torch_dtype(dtype))
            name = names.fresh(names.grad_const(), self.q.vars)
            self.q.add_var(Var(name, dtype, tuple(t.shape), kind="constant"), t)
            self._consts[key] = name
        return self._consts[key]

    def finalize(self, x: str) -> str | None:
        """x@GRAD from x's contributions: rename a single one, sum several."""
        parts = self.contribs.get(x, [])
        if not parts:
            return None
        final = names.grad(x)
        if parts == [final]:
            return final
        if final in self.q.vars and final not in parts:
            raise BackwardError(f"{final!r} already exists in program {self.q.name!r}")
        owned = [p for p in parts if self._owned(p)]
        v = self.q.vars[x]
        if len(parts) == 1 and owned:
            self._rename_owned(parts[0], final)  # a fresh value only this var uses
        elif len(parts) == 1:  # shared with another var (Add passes dy through): alias it
            self.q.add_var(Var(final, v.dtype, v.shape, kind="grad"))
            self.append(Op("Identity", list(parts), [final], role="backward", origin=x))
        else:
            self.q.add_var(Var(final, v.dtype, v.shape, kind="grad"))
            acc = next((p for p in owned if self._fresh(p) and self.q.vars[p].shape == v.shape), None)
            if acc is not None:  # add into new storage nobody else reads, as AccumulateGrad does
                rest = [p for p in parts if p != acc]
                self.append(Op("GradAccumulate", [acc, *rest], [final], role="backward", origin=x))
            else:
                self.append(Op("GradSum", list(parts), [final], role="backward", origin=x))
        self.contribs[x] = [final]
        return final


def append_backward(
    program: Program,
    *,
    loss: str,
    parameter_list: list[str] | None = None,
    no_grad_set: set[str] | None = None,
) -> tuple[Program, list[tuple[str, str]]]:
    """Append the backward of `loss` to a copy of `program`; returns it and (param, grad) pairs."""
    q = program.clone()
    if loss not in q.vars:
        raise BackwardError(f"loss {loss!r} is not a var of program {q.name!r}{did_you_mean(loss, q.vars)}")
    lv = q.vars[loss]
    if lv.dtype not in FLOAT_DTYPES or lv.shape not in ((), None):
        raise BackwardError(f"loss {loss!r} must be a floating scalar, is {lv.dtype}{list(lv.shape or [])}")
    prod = q.producers()
    if loss not in prod:
        raise BackwardError(f"loss {loss!r} is not produced by an op of program {q.name!r}")
    if any(op.role == "backward" for op in q.ops):
        raise BackwardError(f"program {q.name!r} already has backward ops: append_backward runs once")
    stop = {x.name if isinstance(x, Var) else x for x in (no_grad_set or ())}
    for x in stop:
        if x not in q.vars:
            raise BackwardError(
                f"no_grad_set entry {x!r} is not a var of {q.name!r}{did_you_mean(x, q.vars)}"
            )
    params = _params(q, parameter_list, stop)
    end = prod[loss]
    fwd = q.ops[: end + 1]

    # Vars on a path param -> loss, float dtypes only.
    depends = set(params)
    for op in fwd:
        if any(x in depends for x in op.inputs if x):
            depends.update(o for o in op.outputs if o and q.vars[o].dtype in FLOAT_DTYPES and o not in stop)
    reaches = {loss}
    for op in reversed(fwd):
        if any(o in reaches for o in op.outputs):
            reaches.update(x for x in op.inputs if x)
    bw = _Backward(q)
    bw.wanted = depends & reaches

    seed = names.grad(loss)
    if seed in q.vars:
        raise BackwardError(f"{seed!r} already exists in program {q.name!r}")
    q.add_var(Var(seed, lv.dtype, lv.shape, kind="grad"))
    bw.append(Op("Identity", [bw.const(1.0, lv.dtype)], [seed], role="backward", origin=loss))
    bw.contribs[loss] = [seed]

    for op in reversed(fwd):
        douts = [bw.finalize(o) if o in bw.wanted else None for o in op.outputs]
        if not any(douts) or not any(x in bw.wanted for x in op.inputs if x):
            continue
        row = registry.get(op.type)
        g = GradBuilder(bw, op)
        dins = row.grad(g, op, douts) if row is not None and row.grad is not None else g.vjp(op, douts)
        for x, d in zip(op.inputs, dins):
            if d is not None and x in bw.wanted:
                bw.register(x, d)

    params_grads = []
    for p in params:
        if p in bw.wanted:
            final = bw.finalize(p)
            if final:
                params_grads.append((p, final))
    q.ops = [*q.ops, *bw.emitted]
    _prune_unused_vars(q)
    return q, params_grads


def loss_grad_seed(program: Program, loss: str) -> str:
    """The var `append_backward` seeded the backward of `loss` with (d loss / d loss = 1): the
    output of the program's first backward op, whose origin is `loss`."""
    first = next((op for op in program.ops if op.role == "backward"), None)
    if first is None or first.origin != loss or len(first.outputs) != 1:
        raise BackwardError(f"program {program.name!r} has no backward seeded from loss {loss!r}")
    return first.outputs[0]


def _params(q: Program, parameter_list: list[str] | None, no_grad: set[str]) -> list[str]:
    trainable = [v.name for v in q.params()]
    if parameter_list is None:
        chosen = trainable
    else:
        chosen = []
        for p in parameter_list:
            name = p.name if isinstance(p, Var) else p
            if name not in q.vars:
                raise BackwardError(
                    f"parameter {name!r} is not a var of {q.name!r}{did_you_mean(name, trainable)}"
                )
            if q.vars[name].kind != "param":
                raise BackwardError(f"parameter_list entry {name!r} is a {q.vars[name].kind}, not a param")
            chosen.append(name)
    return [p for p in chosen if p not in no_grad]


def _prune_unused_vars(q: Program) -> None:
    used = {x for op in q.ops for x in (*op.inputs, *op.outputs) if x}
    used |= set(q.inputs) | set(q.outputs) | set(q.updates) | set(q.updates.values())
    for name in [
        n for n, v in q.vars.items() if n not in used and v.kind in ("grad", "activation", "constant")
    ]:
        del q.vars[name]
        q.values.pop(name, None)

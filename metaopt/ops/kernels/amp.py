"""Ops of automatic mixed precision's dynamic loss scaling (passes/amp.py, fleet/steps.py).

``CheckFiniteAndUnscale`` is Paddle's ``check_finite_and_unscale`` (torch:
``GradScaler.unscale_``): every grad times ``1 / loss_scaling`` and one flag saying
whether any of them holds an inf or a nan. ``UpdateLossScaling`` is Paddle's
``update_loss_scaling`` rule, operation for operation (Fleet's ``amp_configs``):

* a step with inf/nan grads resets the good-step counter and counts a bad step; after
  ``decr_every_n_nan_or_inf`` bad steps in a row the scale is multiplied by
  ``decr_ratio`` (never below 1) and the bad counter restarts;
* a finite step resets the bad counter and counts a good step; after
  ``incr_every_n_steps`` good steps in a row the scale is multiplied by ``incr_ratio``
  (kept as it was if that is not finite) and the good counter restarts.

Both compute on the device without a host read (``torch.where``); the update ops
read ``found_inf`` on the host to skip the step (see ops/kernels/optim.py), as
``GradScaler.step`` reads its ``found_inf`` before calling ``optimizer.step``.

Watching the scale (`LossScaleWatch`). A model whose grads overflow whatever the scale
(an inf/nan in the batch or the forward), or a scale that cannot get small enough, skips
every step without an error. Both kernels hand what they computed to their executor's watch
(``needs_runtime``: they get the executor's runtime) by reference, and the executor calls
`watch_loss_scale` once after each run: on the CPU one read of ``found_inf`` per step, nothing
per op; on CUDA the flag, the scales and the grads' peaks go to pinned host memory by one
non-blocking copy and are read at a later step, once its event says the copy landed (the step
never waits for the device: capture-safe); on the meta device there is nothing to read.
After a skipped step only, it reads the grads' peaks and names the non-finite grad the
backward made first. It warns on the ``metaopt.amp`` logger when `SKIPS_IN_A_ROW_WARN`
steps in a row were skipped (again at twice, four times ... that many) and on the first skip
at a scale <= 1 (Fleet's rule never shrinks it below 1, so a smaller scale cannot help; again
only after the scale has grown above 1).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from metaopt.ir import Program
from metaopt.ir.dtypes import torch_dtype_from_onnx
from metaopt.ops.registry import register


@register(
    "CheckFiniteAndUnscale",
    domain="metaopt",
    needs_outputs=True,
    needs_runtime=True,  # hands its flag and peaks to the executor's LossScaleWatch
    recomputable=False,
    fresh_outputs=True,
)
def check_finite_and_unscale(
    *inputs: torch.Tensor, to: int | None = None, _nout: int = 2, _rt=None, _key: str = ""
):
    """``(*grads, loss_scaling) -> (*grads / loss_scaling, found_inf)``.

    The grads are multiplied by ``inv = float32(1 / float64(scale))``, the reciprocal
    torch's GradScaler forms (exact for the power-of-two scales of the defaults), into
    new tensors (the scaled grads are left as they were: they may be fetched). `to`
    (an ONNX element type) casts the unscaled grads, e.g. half grads to the float32
    of their master weights (AMP O2). ``found_inf`` is a float32 scalar, 1.0 when any
    unscaled grad holds an inf or a nan (the max-abs of each grad, which a nan
    propagates through and a finite grad never overflows), else 0.0 — torch's
    ``found_inf`` convention: a number, so that workers can sum it (an all-reduce) and
    all skip a step any of them overflowed on. Its readers take nonzero as true.
    """
    *grads, scale = inputs
    if len(grads) + 1 != _nout or not grads:
        raise ValueError(
            f"CheckFiniteAndUnscale: {len(grads)} grads in but {_nout} outputs (the grads and found_inf)"
        )
    inv = scale.double().reciprocal().float()
    if to is not None:
        dtype = torch_dtype_from_onnx(to, what="CheckFiniteAndUnscale")
        grads = [g.to(dtype) for g in grads]
    outs = torch._foreach_mul(list(grads), inv)
    # (a 0-dim half grad times the 0-dim float inv would promote: keep each grad's dtype)
    outs = [o if o.dtype == g.dtype else o.to(g.dtype) for o, g in zip(outs, grads, strict=True)]
    peaks = torch.stack(torch._foreach_norm(outs, float("inf"))).float()
    found_inf = torch.logical_not(torch.isfinite(peaks).all()).float()
    if _rt is not None:  # by reference: nothing is read here
        _watch(_rt).checked = _Checked(_key, found_inf, peaks, scale)
    return (*outs, found_inf)


@register("UpdateLossScaling", domain="metaopt", needs_outputs=True, needs_runtime=True, recomputable=False)
def update_loss_scaling(
    found_inf: torch.Tensor,
    loss_scaling: torch.Tensor,
    good_steps: torch.Tensor,
    bad_steps: torch.Tensor,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    _nout: int = 3,
    _rt=None,
    _key: str = "",
):
    """``(found_inf, scale, good, bad) -> (new scale, new good, new bad)``: Fleet's rule (module doc).

    `found_inf` (bool or a number; nonzero = an overflow) may be a sum over workers."""
    found = found_inf.to(torch.bool)
    zero = torch.zeros_like(good_steps)
    good = torch.where(found, zero, good_steps + 1)
    bad = torch.where(found, bad_steps + 1, zero)
    grow = good >= incr_every_n_steps  # only ever true on a finite step (good was reset otherwise)
    shrink = bad >= decr_every_n_nan_or_inf
    up = loss_scaling * incr_ratio
    up = torch.where(torch.isfinite(up), up, loss_scaling)
    down = torch.clamp(loss_scaling * decr_ratio, min=1.0)
    new_scale = torch.where(grow, up, torch.where(shrink, down, loss_scaling))
    if _rt is not None:  # the flag the skip reads (on a pipeline stage: summed over the stages)
        _watch(_rt).updated = (found_inf, new_scale)
    return new_scale, torch.where(grow, zero, good), torch.where(shrink, zero, bad)


# --- watching the loss scale (module doc) ------------------------------------------------------

logger = logging.getLogger("metaopt.amp")

# Skipped steps in a row before a warning. torch's GradScaler (65536, halved per skip) reaches 64
# in 10 skips; Fleet's defaults (x0.8 every 2nd skip) only 10737, so a model needing a much
# smaller scale is reported during its start-up search too: a warning, logged log2(n) times.
SKIPS_IN_A_ROW_WARN = 10
# Steps whose flags a CUDA watch holds before it has read them (they are read a step or more late,
# once their copy to the host has landed: never by waiting for the device).
MAX_PENDING = 64


@dataclass
class _Checked:
    key: str  # the CheckFiniteAndUnscale op's first output: finds the op (and its grads) again
    found_inf: torch.Tensor
    peaks: torch.Tensor  # max |grad| of each unscaled grad, in the op's input order
    scale: torch.Tensor  # the scale this step's grads were unscaled with


class LossScaleWatch:
    """One executor's run of skipped AMP steps (module doc). Kernels fill `checked` and
    `updated` during a run; `after_step` reads them once and forgets them."""

    def __init__(self) -> None:
        self.checked: _Checked | None = None
        self.updated: tuple[torch.Tensor, torch.Tensor] | None = None  # (found_inf, new scale)
        self.in_a_row = 0  # steps skipped in a row
        self.first_scale = 0.0  # the scale of the first of them
        self.next_warning = SKIPS_IN_A_ROW_WARN
        self.warned_floor = False  # warned of a skip at a scale <= 1 that has not grown since
        self.pending: list[tuple] = []  # CUDA: (copy done, host values, check key), oldest first

    def after_step(self, program: Program) -> None:
        checked, updated = self.checked, self.updated
        self.checked = self.updated = None
        found, new_scale = updated if updated is not None else (checked.found_inf, checked.scale)
        if found.device.type == "cpu":  # reading a CPU tensor costs nothing: at once
            self._observe(program, checked, bool(found.item()), new_scale)
            return
        self._drain(program)
        if found.device.type == "cuda":  # read a later step, once the copy has landed: no sync
            self._stage(checked, found, new_scale)
        # meta: no values to watch (the step is proven free of host reads, this included)

    def _stage(self, checked: _Checked, found: torch.Tensor, new_scale: torch.Tensor) -> None:
        flags = torch.stack([found.float(), new_scale.float(), checked.scale.float()])
        flat = torch.cat([flags, checked.peaks])
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append((done, host, checked.key))
        if len(self.pending) > MAX_PENDING:  # the host ran far ahead: forget the oldest, never wait
            self.pending.pop(0)

    def _drain(self, program: Program) -> None:
        while self.pending and self.pending[0][0].query():
            _, host, key = self.pending.pop(0)
            found, new_scale, scale = host[0], host[1], host[2]
            checked = _Checked(key, found, host[3:], scale)
            self._observe(program, checked, bool(found), new_scale)

    def _observe(self, program: Program, checked: _Checked, found: bool, new_scale: torch.Tensor) -> None:
        """One step's outcome, its values on the host."""
        if not found:  # the one host read of a normal step
            self.in_a_row, self.next_warning = 0, SKIPS_IN_A_ROW_WARN
            if self.warned_floor:  # warn of the floor again once the scale has left it
                self.warned_floor = float(new_scale) <= 1.0
            return
        self.in_a_row += 1
        scale = float(checked.scale)
        if self.in_a_row == 1:
            self.first_scale = scale
        floor = scale <= 1.0 and not self.warned_floor
        if self.in_a_row < self.next_warning and not floor:
            return
        if self.in_a_row >= self.next_warning:
            self.next_warning *= 2  # 10, 20, 40 ...: a stalled job logs a few lines, not one per step
        self.warned_floor = self.warned_floor or scale <= 1.0
        logger.warning("%s", self._message(program, checked, scale, float(new_scale)))

    def _message(self, program: Program, checked: _Checked, scale: float, new_scale: float) -> str:
        n = self.in_a_row
        text = (
            f"AMP skipped {n} step{'s' if n > 1 else ''} in a row: inf/nan grads, so params and optimizer "
            f"state were not updated; {_culprit(program, checked)}; loss scale {scale:g} this step "
            f"(now {new_scale:g}; {self.first_scale:g} at the first skip of this run)"
        )
        if scale <= 1.0:
            text += (
                ". The scale is <= 1, where Fleet's rule stops shrinking it: a smaller scale cannot make "
                "these grads finite. Look for an inf/nan in the batch, the loss or the forward"
            )
        return text


def _culprit(program: Program, checked: _Checked) -> str:
    """Which grads were not finite, naming the one the backward made first: where the overflow
    begins, nearest the loss (read after a skipped step only: then the peaks are worth a host
    read and the program a scan)."""
    bad = torch.nonzero(~torch.isfinite(checked.peaks)).flatten().tolist()
    if not bad:  # a pipeline stage: another stage's grads overflowed (the flags are summed)
        return "every grad of this worker is finite: another pipeline stage's are not (see its log)"
    op = next((o for o in program.ops if o.outputs and o.outputs[0] == checked.key), None)
    if op is None:
        return f"{len(bad)} grad(s) not finite (input {bad[0]} of the check making {checked.key!r})"
    names = [op.inputs[i] for i in bad]
    made = program.producers()
    first = min(names, key=lambda g: made.get(g, len(program.ops)))
    total = len(op.inputs) - 1  # the last input is the scale
    return f"{len(names)} of {total} grads not finite, the first the backward made: {first!r}"


_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # executor runtime -> its watch


def _watch(rt: Any) -> LossScaleWatch:
    w = _WATCHES.get(rt)
    if w is None:
        w = _WATCHES[rt] = LossScaleWatch()
    return w


def watch_loss_scale(rt: Any, program: Program) -> None:
    """Called by the executor once after each run of `program` with its runtime `rt`: warns
    on a stalling loss scale (module doc). Nothing to do unless an AMP check ran this run."""
    w = _WATCHES.get(rt)
    if w is not None and w.checked is not None:
        w.after_step(program)


# --- the device check ------------------------------------------------------------------------

# CUDA compute capability each low dtype needs: half arithmetic came with sm_53, bfloat16
# with Ampere (sm_80; torch emulates it more slowly on older GPUs: refused, not slowed down).
CUDA_CAPABILITY = {"float16": (5, 3), "bfloat16": (8, 0)}
_SUPPORTED: set[tuple[str, str]] = set()


class AmpDeviceError(RuntimeError):
    pass


def check_amp_device(dtype: str, device: torch.device) -> None:
    """Raise AmpDeviceError naming `device` if it cannot run AMP in `dtype` (cached per device)."""
    key = (str(device), dtype)
    if key in _SUPPORTED:
        return
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        need = CUDA_CAPABILITY[dtype]
        if tuple(cap) < need:
            name = torch.cuda.get_device_name(device)
            other = [d for d, c in CUDA_CAPABILITY.items() if tuple(cap) >= c]
            hint = f"use amp_configs['dtype']={other[0]!r}" if other else "turn strategy.amp off"
            raise AmpDeviceError(
                f"amp_configs['dtype']={dtype!r}: {device} ({name}, compute capability "
                f"{cap[0]}.{cap[1]}) has no {dtype} support (needs {need[0]}.{need[1]} or newer); {hint}"
            )
    else:
        dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        try:  # the kernels AMP leans on: matmul, layer norm on mixed inputs, softmax
            a = torch.ones(2, 2, dtype=dt, device=device)
            torch.nn.functional.linear(a, a, a[0])
            torch.native_layer_norm(a, (2,), torch.ones(2, device=device), None, 1e-5)
            torch.softmax(a.float(), -1)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            raise AmpDeviceError(
                f"amp_configs['dtype']={dtype!r}: this torch build has no {dtype} kernels on {device} "
                f"({str(e).splitlines()[0]})"
            ) from e
    _SUPPORTED.add(key)


@register("CheckAmpDevice", domain="metaopt", needs_device=True, host_outputs=True, recomputable=False)
def check_amp_device_op(*, dtype: str, _device: torch.device) -> torch.Tensor:
    """Refuses, before the first low-precision op runs, a device that cannot run `dtype`
    (the executor's device is only known when the program runs). No inputs; its output
    (true, a host value nothing reads) is there because an ONNX node needs one."""
    check_amp_device(dtype, _device)
    return torch.tensor(True)

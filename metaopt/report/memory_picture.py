"""The memory picture's data: live bytes at every op of one step, predicted and measured.

Predicted is `estimate_memory`'s replay (``workspace=False``: the vars the executor counts;
a second series adds the kernels' declared temporaries where any op has some). Measured is
the executor's own accounting, recorded after each op (``Executor(record_timeline=True)``):
the same count as ``exe.memory_stats()["peak_bytes"]``, so the two lines agree exactly
wherever the ops' rows describe their storage (a view, an in-place write), and where they
part the picture shows which op the estimate misjudges.

This module sits above both passes/ (the estimate) and runtime/ (the executor), which may not
import each other; the drawing is in `metaopt.report.plot` (matplotlib, an optional extra).

Measuring needs a feed: the caller's, or one made from the inputs' shapes with every symbolic
dim bound (integers are zeros, a valid index for any gather; floats standard normal). A
program that cannot be run alone (a pipeline stage, which needs its peers; unbound dims; an
op that fails here, such as a collective without a process group) is pictured predicted
only, and `MemoryPicture.note` says why.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from metaopt import limits
from metaopt.ir import Program, eval_dim, roles, torch_dtype
from metaopt.ir.printer import fmt_op
from metaopt.ir.program import device_form
from metaopt.passes.memory_estimate import MemoryWhere, estimate_memory, human_bytes, where_alive
from metaopt.runtime.executor import Executor


@dataclass
class MemoryPicture:
    """Live device bytes over the ops of one step (index = op index in `program`)."""

    name: str
    dims: dict[str, int]
    device: str
    roles: list[str]  # per op
    labels: list[str]  # per op: its printed line
    predicted: list[int]  # estimate_memory(workspace=False).timeline: what the executor counts
    persistable_bytes: int  # params, buffers, optimizer state, constants (predicted)
    where: MemoryWhere  # what is alive at `peak_op` (by the estimate)
    measured: list[int | None] | None = None  # the executor's count; None: not measured
    with_workspace: list[int] | None = None  # predicted plus kernel temporaries, when any
    measured_peak_bytes: int | None = None  # exe.memory_stats()["peak_bytes"] of that run
    note: str = ""  # why there is no measured line ("" when there is)
    files: list[str] = field(default_factory=list)  # what `write` wrote
    persistables: str = ""  # what the persistables are: `persistable_breakdown`
    host: dict[str, int] = field(default_factory=dict)  # estimate_memory's host account, by holder

    @property
    def predicted_peak(self) -> tuple[int, int]:
        """(op, bytes) of the predicted peak (the first op reaching it)."""
        return _argmax(self.predicted)

    @property
    def measured_peak(self) -> tuple[int, int] | None:
        """(op, bytes) of the measured peak, or None when not measured."""
        if self.measured is None:
            return None
        return _argmax(self.measured)

    @property
    def peak(self) -> tuple[int, int]:
        """(op, bytes) the picture marks: the measured peak, else the predicted one."""
        return self.measured_peak or self.predicted_peak

    def summary(self, n: int = 10) -> str:
        """A text report: both peaks, where they are, and the largest storages there."""
        dims = ", ".join(f"{k}={v}" for k, v in self.dims.items()) or "no symbolic dims"
        lines = [f"# memory picture of {self.name!r} ({len(self.roles)} ops, {dims}, {self.device})"]
        op, b = self.predicted_peak
        lines.append(f"predicted peak: {human_bytes(b)} ({b:,} B) at op {op}")
        if self.with_workspace is not None:
            wop, wb = _argmax(self.with_workspace)
            lines.append(f"predicted with kernel workspace: {human_bytes(wb)} ({wb:,} B) at op {wop}")
        if self.measured_peak is not None:
            mop, mb = self.measured_peak
            lines.append(f"measured peak:  {human_bytes(mb)} ({mb:,} B) at op {mop}")
            differ = sum(1 for m, p in zip(self.measured, self.predicted) if m is not None and m != p)
            if differ:
                lines.append(f"measured and predicted differ at {differ} of {len(self.predicted)} ops")
        else:
            lines.append(f"measured: no run, predicted only ({self.note})")
        lines.append(f"persistables (params, state, constants): {human_bytes(self.persistable_bytes)}")
        if self.persistables:
            lines.append(f"  {self.persistables}")
        if self.host:
            held = ", ".join(f"{k} {human_bytes(b)}" for k, b in self.host.items())
            lines.append(
                f"host memory beside the device (predicted): {human_bytes(sum(self.host.values()))}: {held}"
            )
        lines.append(self.where.format(n))
        return "\n".join(lines) + "\n"

    def write(self, out: str | os.PathLike, *, stem: str | None = None) -> list[str]:
        """Write ``<stem>.png``, ``<stem>.html`` (an SVG with a tooltip per op) and
        ``<stem>.txt`` (the summary) under folder `out`; returns their paths."""
        from metaopt.report import plot

        os.makedirs(out, exist_ok=True)
        base = os.path.join(out, stem or f"{_safe(self.name)}_memory")
        self.files = [plot.write_png(self, base + ".png"), plot.write_html(self, base + ".html")]
        with open(base + ".txt", "w") as f:
            f.write(self.summary())
        self.files.append(base + ".txt")
        return list(self.files)


def memory_picture(
    program: Program,
    feed: Mapping[str, Any] | None = None,
    *,
    dims: Mapping[str, int] | None = None,
    batch: int | None = None,
    fetches: Sequence[str] = (),
    device: str = "cpu",
    measure: bool = True,
    out: str | os.PathLike | None = None,
    max_bytes: int | None = None,
) -> MemoryPicture:
    """The memory picture of one step of `program` (module doc); written under `out` if given.

    `feed`: the inputs to measure with (their shapes bind the symbolic dims); without one, a
    feed is made from the inputs' shapes with `dims` (and ``batch`` for the dim ``"batch"``)
    bound. `fetches`: kept alive to the end, as `exe.run`'s fetch_list (default: the loss, or
    the program's outputs). `measure=False` skips the run (predicted only). A run whose predicted
    peak exceeds `max_bytes` (default `metaopt.limits.LIMITS.max_run_bytes`) is refused before it
    starts when its predicted peak is over `limits.RUN_MARGIN` of it, with a `limits.RunTooLarge`
    naming both figures."""
    bound = dict(dims or {})
    if batch is not None:
        bound["batch"] = batch
    if feed is not None:
        bound.update(_dims_of_feed(program, feed))
    keep = tuple(fetches) or ((program.loss_name,) if program.loss_name else tuple(program.outputs))
    form = device_form(device)
    est = estimate_memory(program, dims=bound, fetches=keep, workspace=False, device=form)
    pic = MemoryPicture(
        name=program.name,
        dims=bound,
        device=str(device),
        roles=[op.role for op in program.ops],
        labels=[fmt_op(op) for op in program.ops],
        predicted=list(est.timeline),
        persistable_bytes=est.persistable_bytes,
        where=est.where,
        persistables=persistable_breakdown(program),
        host=dict(est.host),
    )
    full = estimate_memory(program, dims=bound, fetches=keep, workspace=True, device=form)
    if full.timeline != est.timeline:
        pic.with_workspace = list(full.timeline)
    if measure:
        _check_run_bytes(program, max(full.timeline, default=0), max_bytes)
        _measure(pic, program, feed, bound, keep, device)
    else:
        pic.note = "measuring was turned off (measure=False, --no-measure)"
    op, _ = pic.peak
    if op != est.peak_op:  # the where view follows the marked peak
        pic.where = where_alive(program, op, dims=bound, fetches=keep, workspace=False)
    if out is not None:
        pic.write(out)
    return pic


def _check_run_bytes(program: Program, peak: int, max_bytes: int | None) -> None:
    limit = limits.LIMITS.max_run_bytes if max_bytes is None else max_bytes
    if peak > limit * limits.RUN_MARGIN:
        raise limits.RunTooLarge(
            f"{program.name!r}: one step is predicted to peak at {limits.fmt_bytes(peak)}, over "
            f"{limits.RUN_MARGIN:g} of the limit of {limits.fmt_bytes(limit)} for a measured run (the "
            "process holds more than the prediction counts: kernel temporaries); measure=False draws the "
            f"prediction alone; if the file is trusted, raise the limit: --max-bytes N (CLI), "
            f"memory_picture(..., max_bytes=N) or metaopt.limits.LIMITS.max_run_bytes = N"
        )


def _measure(
    pic: MemoryPicture, p: Program, feed, dims: dict[str, int], keep: tuple[str, ...], device: str
) -> None:
    """Fill `pic.measured` from a run, or `pic.note` with why there is none."""
    if p.pipeline is not None:
        pic.note = "a pipeline stage program needs its peer stages (run it under metaoptrun)"
        return
    if feed is None:
        feed, why = random_feed(p, dims)
        if feed is None:
            pic.note = why
            return
    try:
        pic.measured, pic.measured_peak_bytes = measure_timeline(p, feed, keep, device)
    except Exception as e:  # noqa: BLE001 - the picture degrades to predicted only, saying why
        pic.note = f"the run failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def measure_timeline(
    p: Program, feed: Mapping[str, Any], fetches: Sequence[str], device: str = "cpu"
) -> tuple[list[int | None], int]:
    """(live bytes after each op of `p` by the executor's count, ``memory_stats()["peak_bytes"]``
    of that run). Startup ops run once before the recorded step (None there); a
    gradient-merge program is run until a step runs its update phase, so every op has a count."""
    startup = 0
    while startup < len(p.ops) and roles.is_startup(p.ops[startup].role):
        startup += 1
    body = len(p.ops) - startup
    runs = (p.gradient_merge.k_steps if p.gradient_merge is not None else 1) + (startup > 0)
    exe = Executor(device, record_timeline=True)
    for _ in range(runs):
        exe.reset_memory_stats()  # the peak of the recorded step alone
        exe.run(p, feed=feed, fetch_list=list(fetches), return_numpy=False)
        timeline = exe.memory_timeline()
        if len(timeline) == body:
            return [None] * startup + timeline, int(exe.memory_stats()["peak_bytes"])
    raise RuntimeError(
        f"no run of program {p.name!r} ran all its {body} ops in {runs} runs (last ran {len(timeline)})"
    )


def random_feed(p: Program, dims: Mapping[str, int]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(a feed for every input of `p` with `dims` bound, "") or (None, why not)."""
    gen = torch.Generator().manual_seed(0)
    feed = {}
    for name in p.inputs:
        v = p.vars[name]
        if v.shape is None:
            return None, f"input {name!r} has no known shape: pass a feed"
        shape = [eval_dim(d, dict(dims)) for d in v.shape]
        if None in shape:
            free = [d for d, s in zip(v.shape, shape) if s is None]
            return None, f"input {name!r} has unbound dims {free}: bind them (--dim NAME=N) or pass a feed"
        dtype = torch_dtype(v.dtype)
        if dtype.is_floating_point:
            feed[name] = torch.randn(shape, generator=gen).to(dtype)
        else:  # zeros: a valid index, label and mask for any model
            feed[name] = torch.zeros(shape, dtype=dtype)
    return feed, ""


def _dims_of_feed(p: Program, feed: Mapping[str, Any]) -> dict[str, int]:
    """The symbolic dims the feed's shapes bind (string dims of the inputs' shapes)."""
    out: dict[str, int] = {}
    for name, value in feed.items():
        v = p.vars.get(name)
        if v is None or v.shape is None:
            continue
        shape = tuple(torch.as_tensor(value).shape)
        for d, n in zip(v.shape, shape):
            if isinstance(d, str) and d.isidentifier():
                out.setdefault(d, int(n))
    return out


def _argmax(xs: Sequence[int | None]) -> tuple[int, int]:
    best, at = -1, -1
    for i, x in enumerate(xs):
        if x is not None and x > best:
            best, at = x, i
    return at, max(best, 0)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "program"


def unit_for(nbytes: float) -> tuple[str, float]:
    """The binary unit a byte axis up to `nbytes` reads best in, and its size."""
    exp = 0 if nbytes <= 0 else min(3, int(math.log(nbytes, 1024)))
    return ("B", "KiB", "MiB", "GiB")[exp], float(1024**exp)


def persistable_breakdown(program: Program) -> str:
    """One line: params, optimizer state (with ZeRO: this worker's share of the whole state; at
    stage 3 of the whole params too; with optimize_offload, in host memory) and the rest
    (buffers, counters, constants), as this worker holds them."""
    held = {"param": 0, "opt_state": 0}
    whole = {"param": 0, "opt_state": 0}
    other = 0
    for v in program.vars.values():
        if not v.persistable or v.shape is None:
            continue
        n = v.nbytes({}) or 0
        if v.kind not in held:
            other += n
            continue
        held[v.kind] += n
        whole[v.kind] += v.zero.full_numel * torch_dtype(v.dtype).itemsize if v.zero is not None else n
    zero = {v.zero.parts for v in program.vars.values() if v.zero is not None and v.persistable}
    share = f"this worker's 1/{max(zero)} of" if zero else ""
    params = human_bytes(held["param"])
    if zero and whole["param"] != held["param"]:
        params += f" (ZeRO: {share} {human_bytes(whole['param'])})"
    text = f"params {params}, optimizer state {human_bytes(held['opt_state'])}"
    if zero:
        text += f" (ZeRO: {share} {human_bytes(whole['opt_state'])})"
    if any(v.host for v in program.vars.values()):  # ZeRO-Offload: not device bytes
        text += " in host memory"
    return text + f", other {human_bytes(other)}"

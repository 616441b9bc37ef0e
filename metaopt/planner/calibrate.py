"""The planner's time model, measured on the device it plans for (issue 45: "calibrate it").

`fleet.plan` prices a worker's step op by op (planner.py):

    op            op_seconds + FLOPs / device_flops + bytes touched / device_bytes_per_s
    collective    link_latency_s + bytes over the ring / link_bytes_per_s

`Rates` holds the five numbers. Declared, they are a roofline's guesses; `calibrate` measures them:

* compute: one program (the model's own training step in one process, or any program without
  collectives) is run with the executor timing each op (``Executor(record_op_times=True)``), the
  fastest of `runs` runs per op, and the three compute rates are the non-negative least-squares
  fit of those times to the ops' FLOPs (their rows' rules, ops/costs.py) and bytes. The per-op
  cost is what small models on a CPU are made of (Python and dispatch: tens of microseconds an op);
  FLOPs dominate large matmuls; bytes, elementwise ops over large tensors.
* links: `measure_links` times all-reduces of growing sizes over the initialized process group
  (every worker calls it), the fastest of `reps` each, and fits latency + size / bandwidth.

Measure where the job will run, as it will run: on a CPU whose cores its workers share, every
worker measuring at once (benchmarks/planner.py does), since a core shared by two workers gives
each half its rate. On a GPU cluster: `calibrate` on one GPU (compute), `measure_links` within a
node and across nodes (the slower one for groups that span nodes); docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metaopt.ir import Program, roles
from metaopt.ops import costs, registry


@dataclass(frozen=True)
class Rates:
    """What the planner's time model charges (module doc). `measured`: how they were obtained
    ("" for declared figures)."""

    device_flops: float = 1e12
    device_bytes_per_s: float = 1e11
    op_seconds: float = 0.0
    link_bytes_per_s: float = 1e10
    link_latency_s: float = 1e-5
    measured: str = ""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Rates:
        data = json.loads(Path(path).read_text())
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Rates.load({str(path)!r}): unknown field(s) {unknown}")
        return cls(**data)


def op_cost(p: Program, op: Any, dims: Mapping[str, int]) -> tuple[float, float]:
    """(FLOPs, bytes touched) of one op of `p` under `dims`: the features the compute rates price.
    A view (Reshape, Transpose ...) touches nothing."""
    row = registry.get(op.type)
    if row is not None and row.view:
        return 0.0, 0.0
    moved = sum(_nbytes(p, x, dims) for x in [*op.inputs, *op.outputs] if x)
    return costs.op_flops(p, op, dict(dims)), float(moved)


def _nbytes(p: Program, name: str, dims: Mapping[str, int]) -> int:
    v = p.vars.get(name)
    return 0 if v is None else (v.nbytes(dict(dims)) or 0)


def time_ops(exe: Any, p: Program, feed: Mapping[str, Any], *, runs: int = 3) -> list[tuple[Any, float]]:
    """(op, the fastest of `runs` timed runs' seconds) for every op of `p`'s step (its startup ops,
    which run once, left out), run by `exe`, a ``metaopt.Executor(device, record_op_times=True)``
    on the device to calibrate. `p` must run in this process: no collectives without peers."""
    body = [op for op in p.ops if not roles.is_startup(op.role)]
    best: list[float] | None = None
    exe.run(p, feed=dict(feed), return_numpy=False)  # warm: the plan is built, the allocator primed
    for _ in range(runs):
        exe.run(p, feed=dict(feed), return_numpy=False)
        got = exe.op_seconds()
        if len(got) != len(body):
            raise RuntimeError(
                f"time_ops: program {p.name!r} ran {len(got)} of its {len(body)} step ops: a program "
                "that skips ops per run (gradient merge, a pipeline) cannot be timed op by op"
            )
        best = got if best is None else [min(a, b) for a, b in zip(best, got, strict=True)]
    return list(zip(body, best or [], strict=True))


def fit_compute(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(op_seconds, device_flops, device_bytes_per_s) fitting seconds ~ c + flops / F + bytes / B
    over `samples` of (flops, bytes, seconds), every coefficient >= 0.

    The ops that cost nothing by the model (views, bookkeeping: no FLOPs, no bytes) measure `c`
    alone: it is their median time. The two rates are then the least squares of the others' time
    beyond `c` (the best of the subsets whose coefficients are non-negative). Without such ops,
    the three are fit together. A term the fit leaves out gets an infinite rate: it costs
    nothing. (One fit of all three over absolute times is the big matmuls' fit: it can leave a
    per-op cost below zero, and tiny ops are most of a small model's step.)"""
    if not samples:
        raise ValueError("fit_compute: no timed ops")
    free = sorted(s for f, b, s in samples if f == 0 and b == 0)
    rest = [(f, b, s) for f, b, s in samples if f or b]
    if free:
        c = free[len(free) // 2]
        if not rest:
            return c, float("inf"), float("inf")
        _, per_flop, per_byte = _nonnegative_fit([(f, b, s - c) for f, b, s in rest], with_constant=False)
    else:
        c, per_flop, per_byte = _nonnegative_fit(rest, with_constant=True)
    return (
        c,
        (1.0 / per_flop if per_flop > 0 else float("inf")),
        (1.0 / per_byte if per_byte > 0 else float("inf")),
    )


def _nonnegative_fit(samples, with_constant: bool) -> tuple[float, float, float]:
    x = torch.tensor([[1.0, f, b] for f, b, _ in samples], dtype=torch.float64)
    y = torch.tensor([s for *_, s in samples], dtype=torch.float64)
    scale = x.abs().amax(0).clamp_min(1.0)  # columns of 1, 1e9 FLOPs and 1e7 bytes: condition them
    best, best_err = None, float("inf")
    for mask in range(1, 8):
        cols = [j for j in range(3) if mask >> j & 1]
        if 0 in cols and not with_constant:
            continue
        a = x[:, cols] / scale[cols]
        coef = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1) / scale[cols]
        if (coef < 0).any():
            continue
        err = float(((x[:, cols] @ coef) - y).square().sum())
        if err < best_err:
            full = torch.zeros(3, dtype=torch.float64)
            full[cols] = coef
            best, best_err = full, err
    if best is None:  # every subset went negative: charge the mean op time per op
        best = torch.tensor([max(float(y.mean()), 0.0), 0.0, 0.0], dtype=torch.float64)
    c, per_flop, per_byte = (float(v) for v in best)
    return c, per_flop, per_byte


def calibrate(
    exe: Any,
    p: Program,
    feed: Mapping[str, Any],
    dims: Mapping[str, int],
    *,
    runs: int = 3,
    links: tuple[float, float] | None = None,
) -> Rates:
    """`Rates` measured by `exe` (``metaopt.Executor(device, record_op_times=True)``) from `p`
    (module doc; `dims`: what `feed` binds), with the link figures `links` = (latency s, bytes/s)
    from `measure_links`, else the declared ones."""
    timed = time_ops(exe, p, feed, runs=runs)
    samples = [(*op_cost(p, op, dims), s) for op, s in timed]
    c, flops, bps = fit_compute(samples)
    link = links or (Rates.link_latency_s, Rates.link_bytes_per_s)
    what = f"{len(samples)} ops of {p.name!r} on {exe.device}, fastest of {runs} runs"
    if links is not None:
        what += "; links measured"
    return Rates(
        device_flops=flops,
        device_bytes_per_s=bps,
        op_seconds=c,
        link_latency_s=link[0],
        link_bytes_per_s=link[1],
        measured=what,
    )


def measure_links(sizes: Sequence[int] = (1 << 10, 1 << 20, 1 << 22), reps: int = 5) -> tuple[float, float]:
    """(latency s, bytes/s) of the initialized process group's all-reduce, from the fastest of
    `reps` all-reduces of each size (float32 bytes; the first of each is a warm-up): the latency
    is the smallest size's time, the bandwidth the largest's ring bytes (2 (n - 1) / n of the
    buffer per worker) over its time beyond that latency. Two points, not a fit over all: on a
    busy machine a least-squares line through noisy times can drop either term. Every worker of
    the group must call it."""
    from metaopt.layout.groups import initialized_dist

    dist = initialized_dist()
    n = dist.get_world_size()
    times = []
    for size in sorted(sizes):
        t = torch.zeros(max(size // 4, 1))
        best = float("inf")
        for k in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if k:  # the first: the connection's warm-up
                best = min(best, time.perf_counter() - t0)
        times.append((t.numel() * 4 * 2 * (n - 1) / max(n, 1), best))
    latency = times[0][1]
    ring, largest = times[-1]
    beyond = largest - latency if largest > 2 * latency else largest  # the latency's share unseen
    return latency, max(ring, 1.0) / beyond

"""Mixture-of-experts kernels: the grouped matmul over tokens sorted by expert.

``GroupedMatMul(x, weight, offsets)``: ``x`` [S, K] holds S token rows sorted by expert,
``weight`` [E, K, N] one matrix per expert, ``offsets`` [E] the cumulative row counts (expert
``e`` owns rows ``offsets[e-1]:offsets[e]``). Row ``s`` of the output [S, N] is
``x[s] @ weight[e]`` for its expert ``e``; rows at or past ``offsets[-1]`` (tokens routed to no
local expert) are zero. This is ``torch.nn.functional.grouped_mm(x, weight, offs=offsets)`` and
transformers' ``grouped_mm_fallback``, what HF's MoE layers run (transformers >= 5).

Every expert is a slice of the one weight, so an export keeps all of them whatever the example
input routes (a per-expert loop traced over the example's routing keeps only the experts it saw).

The group sizes are data: the kernel reads ``offsets`` on the host once per call (one sync on a
GPU, as HF's fallback). The output's shape never depends on them.
"""

from __future__ import annotations

import fractions
import logging
import math

import torch

from metaopt.ops.registry import register


def _groups(offsets: torch.Tensor, experts: int, rows: int) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every non-empty group; the offsets checked as the op defines them."""
    ends = [int(v) for v in offsets.tolist()]
    if len(ends) != experts:
        raise ValueError(f"GroupedMatMul: {len(ends)} offsets for {experts} experts")
    out, start = [], 0
    for e, end in enumerate(ends):
        if end < start or end > rows:
            raise ValueError(
                f"GroupedMatMul: offsets must be non-decreasing and at most the {rows} rows, got {ends}"
            )
        if end > start:
            out.append((e, start, end))
        start = end
    return out


@register(
    "GroupedMatMul",
    domain="metaopt",
    fresh_outputs=True,
    expensive=True,
    amp="white",
    expert_inputs=(0, 1, 2),
)
def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=x.dtype, device=x.device)
    if x.device.type == "meta":
        return out  # shapes only: the output's never depends on the routing
    for e, s, t in _groups(offsets, weight.shape[0], x.shape[0]):
        torch.mm(x[s:t], weight[e], out=out[s:t])
    return out


@register("GroupedMatMulGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True, masks_outputs=True)
def grouped_matmul_grad(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    mask: list[int] | None = None,
    _nout: int = 2,
):
    """(dx, dweight) of GroupedMatMul, per group as torch's mm backward forms them:
    ``dx[g] = dy[g] @ weight[e].T`` and ``dweight[e] = x[g].T @ dy[g]``; rows past the last
    offset and experts with no rows get zeros. `mask` says which are wanted."""
    want = list(mask or [1, 1]) + [0, 0]
    dx = torch.zeros_like(x) if want[0] else None
    dw = torch.zeros_like(weight) if want[1] else None
    if x.device.type != "meta":
        for e, s, t in _groups(offsets, weight.shape[0], x.shape[0]):
            if dx is not None:
                torch.mm(dy[s:t], weight[e].t(), out=dx[s:t])
            if dw is not None:
                torch.mm(x[s:t].t(), dy[s:t], out=dw[e])
    return (dx, dw)[:_nout]


def offset_counts(offsets: torch.Tensor, rows: int, op: str) -> torch.Tensor:
    """Each expert's row count (int64, on the host) from cumulative `offsets`, checked as
    GroupedMatMul defines them: non-decreasing, at most `rows`; else a ValueError naming `op`."""
    ends = offsets.detach().to("cpu", torch.int64).reshape(-1)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    if counts.numel() and (int(counts.min()) < 0 or int(ends[-1]) > rows):
        raise ValueError(
            f"{op}: offsets must be non-decreasing and at most the {rows} rows, got {ends.tolist()}"
        )
    return counts


# --- expert capacity (passes/expert_capacity.py) ------------------------------------------------
# Each expert serves at most `capacity` rows per step (GShard / Megatron's capacity factor): rows
# past it are dropped (their expert output is zero; the token keeps its other experts' and the
# residual), and every expert's rows sit in a slot of exactly `capacity` rows, zero-padded, so the
# shapes never depend on the routing (what CUDA graphs need). The layout, an int64 host tensor:
# ``[n, experts, capacity, dropped, counts (experts)]``.

_capacity_log = logging.getLogger("metaopt.moe")


def capacity_of(capacity_factor: float, rows: int, experts: int) -> int:
    """Slots per expert: ceil(capacity_factor x rows / experts), as the pass writes it in dims."""
    num, den = capacity_ratio(capacity_factor)
    return (num * rows + den * experts - 1) // (den * experts)


def capacity_ratio(capacity_factor: float) -> tuple[int, int]:
    """The capacity factor as the fraction (numerator, denominator) capacities are computed with,
    here and in the dims the pass writes (passes/expert_capacity.py)."""
    f = fractions.Fraction(capacity_factor).limit_denominator(1000)
    return f.numerator, f.denominator


@register(
    "CapacityRoute", domain="metaopt", host_outputs=True, recomputable=False, needs_runtime=True, equal_runs=1
)
def capacity_route(
    offsets: torch.Tensor, x: torch.Tensor, *, capacity_factor: float, _rt, _key: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layout, the slots' offsets [E]: (e+1) x capacity, the rows dropped: int64 scalar)."""
    experts, n = offsets.shape[0], x.shape[0]
    cap = capacity_of(capacity_factor, n, experts)
    slots = torch.arange(1, experts + 1, dtype=offsets.dtype) * cap
    if offsets.device.type == "meta":  # shapes only: nothing routed, nothing dropped
        head = torch.tensor([n, experts, cap, 0], dtype=torch.int64)
        return (
            torch.cat([head, torch.zeros(experts, dtype=torch.int64)]),
            slots,
            torch.zeros((), dtype=torch.int64),
        )
    counts = offset_counts(offsets, n, "CapacityRoute")
    dropped = int((counts - cap).clamp(min=0).sum())
    if dropped:  # warned at the 1st, 10th, 100th ... step of this executor that drops rows here
        key = f"capacity drops {_key}"
        times = _rt.counters[key] = _rt.counters.get(key, 0) + 1
        if times == 1 or math.log10(times).is_integer():
            _capacity_log.warning(
                "expert capacity %d (capacity_factor %g) dropped %d of %d rows at %s (step %d that dropped)",
                cap,
                capacity_factor,
                dropped,
                int(counts.sum()),
                _key,
                times,
            )
    head = torch.tensor([n, experts, cap, dropped], dtype=torch.int64)
    return torch.cat([head, counts]), slots, torch.tensor(dropped, dtype=torch.int64)


def _slots(layout: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(n, source rows, slot rows) of the rows kept: source row in the sorted input, its slot."""
    n, experts, cap = (int(v) for v in layout[:3].tolist())
    counts = layout[4 : 4 + experts]
    starts = torch.cumsum(counts, 0) - counts
    src, dst = [], []
    for e in range(experts):
        k = min(int(counts[e]), cap)
        src.append(torch.arange(int(starts[e]), int(starts[e]) + k))
        dst.append(torch.arange(e * cap, e * cap + k))
    return n, torch.cat(src), torch.cat(dst)


def _pack_grad(g, op, dy):
    return [g.emit1("CapacityUnpack", [dy[0], op.inputs[1]], like=op.inputs[0]), None]


def _unpack_grad(g, op, dy):
    return [g.emit1("CapacityPack", [dy[0], op.inputs[1]], like=op.inputs[0]), None]


@register("CapacityPack", domain="metaopt", fresh_outputs=True, host_inputs=(1,), grad=_pack_grad)
def capacity_pack(x: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert into `capacity` slots per expert (zero padding; rows past an
    expert's capacity left out): [experts x capacity, ...]."""
    experts, cap = int(layout[1]), int(layout[2])
    out = torch.zeros((experts * cap, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.device.type == "meta":
        return out
    _, src, dst = _slots(layout)
    out[dst.to(x.device)] = x[src.to(x.device)]
    return out


@register("CapacityUnpack", domain="metaopt", fresh_outputs=True, host_inputs=(1,), grad=_unpack_grad)
def capacity_unpack(y: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """The inverse of CapacityPack: each kept row back at its sorted place, dropped rows zero."""
    n = int(layout[0])
    out = torch.zeros((n, *y.shape[1:]), dtype=y.dtype, device=y.device)
    if y.device.type == "meta":
        return out
    _, src, dst = _slots(layout)
    out[src.to(y.device)] = y[dst.to(y.device)]
    return out

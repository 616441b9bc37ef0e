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

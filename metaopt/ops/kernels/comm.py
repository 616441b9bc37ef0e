"""Collective ops (data parallel's all-reduce), run through the executor's communicator."""

from __future__ import annotations

import torch

from metaopt.ops.registry import register


@register(
    "AllReduce",
    domain="metaopt",
    needs_runtime=True,
    fresh_outputs=True,
    recomputable=False,
    notes="outputs = inputs reduced over every worker, one fused buffer per op (a bucket)",
)
def all_reduce(*xs: torch.Tensor, reduce: str = "avg", _rt, _key: str) -> tuple[torch.Tensor, ...]:
    return tuple(_rt.comm.all_reduce(xs, reduce, f"{len(xs)} tensor(s) ({_key}, ...)"))

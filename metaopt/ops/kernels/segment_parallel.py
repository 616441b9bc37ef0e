"""Segment parallel's exchange (passes/segment_parallel.py inserts it around attention).

``SepAllToAll(x)`` (DeepSpeed-Ulysses' all-to-all): `x` is cut into `degree` equal chunks along
`scatter_axis`; chunk j goes to the j-th rank of the group (ascending), and the chunks received
are concatenated along `gather_axis` in group order. Before attention (scatter the heads, gather
the sequence) a rank trades its chunk of the sequence over every head for the whole sequence over
its 1/degree of the heads; after it, the output goes back the other way. Its backward is the
exchange back (the same pieces moved in reverse). `group` is a list of global ranks or
``"sep_parallel"`` (this worker's sep group of fleet.init's layout); a group of one is the
identity.
"""

from __future__ import annotations

import torch

from metaopt.ops.kernels.partition import group_ranks
from metaopt.ops.registry import register_collective


def _exchange_grad(g, op, dy):
    a = op.attrs
    group = a["group"] if isinstance(a["group"], str) else list(a["group"])
    return [g.emit1("SepAllToAll", [dy[0]], like=op.inputs[0], scatter_axis=a["gather_axis"],
                    gather_axis=a["scatter_axis"], group=group)]  # fmt: skip


@register_collective(
    "SepAllToAll",
    fresh_outputs=True,
    # every rank of the group runs the same program, so a recomputed exchange meets its peers'
    recomputable=True,
    grad=_exchange_grad,
    notes="segment parallel: chunks along `scatter_axis` traded over `group`, received along `gather_axis`",
)
def sep_all_to_all(
    x: torch.Tensor, scatter_axis: int, gather_axis: int, group: list[int] | str, _rt, _key: str
) -> torch.Tensor:
    ranks = group_ranks(group, "SepAllToAll")
    n = len(ranks)
    if n == 1:
        return x.clone()
    if x.shape[scatter_axis] % n:
        raise ValueError(
            f"SepAllToAll: dim {scatter_axis} of {list(x.shape)} is not divisible by the group's {n} ranks"
        )
    pieces = torch.stack(torch.chunk(x, n, scatter_axis))  # piece j: for the j-th rank
    got = _rt.comm.all_to_all(pieces, [1] * n, [1] * n, f"{_key} over sep group {ranks}", ranks)
    return torch.cat(got.unbind(0), gather_axis)

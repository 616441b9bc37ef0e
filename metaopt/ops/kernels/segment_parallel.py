"""Segment parallel's exchange (passes/segment_parallel.py inserts it around attention).

``SepAllToAll(x)`` (DeepSpeed-Ulysses' all-to-all): `x` is cut into `degree` equal chunks along
`scatter_axis`; chunk j goes to the j-th rank of the group (ascending), and the chunks received
are concatenated along `gather_axis` in group order. Before attention (scatter the heads, gather
the sequence) a rank trades its chunk of the sequence over every head for the whole sequence over
its 1/degree of the heads; after it, the output goes back the other way. Its backward is the
exchange back (the same pieces moved in reverse). `group` is a list of global ranks or
``"sep_parallel"`` (this worker's sep group of fleet.init's layout); a group of one is the
identity.

``FeedsAgree(*feeds)``: on the first run, every rank of the group checks that it was fed what the
others were (one batch per sep group), and all raise alike, naming the feed, if not.
"""

from __future__ import annotations

import hashlib

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


def _digest(t: torch.Tensor) -> int:
    """A 63-bit digest of `t`'s shape, dtype and bytes (equal feeds give equal digests)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


@register_collective(
    "FeedsAgree",
    recomputable=False,  # a check, not a value: made once, in the forward
    notes="segment parallel: the feeds' digests compared over `group` on the first run (one batch per group)",
)
def feeds_agree(
    *feeds: torch.Tensor, names: list[str], group: list[int] | str, _rt, _key: str
) -> torch.Tensor:
    """Every rank of a sep group must be fed the same batch (each keeps its own chunk of every
    sequence): fed different ones, the run would compute a loss of no batch at all, silently. On
    this executor's first run the ranks trade a digest of each feed and all raise alike, naming the
    first feed and rank that differ; later runs only pass (a host read per run would break the
    step's capture)."""
    ranks = group_ranks(group, "FeedsAgree")
    if len(ranks) == 1 or _rt.counters.get(f"FeedsAgree:{_key}"):
        return torch.ones((), dtype=torch.bool)
    mine = torch.tensor([_digest(t) for t in feeds], dtype=torch.int64)
    got = _rt.comm.all_gather(mine, f"{_key}: the feeds' digests over sep group {ranks}", ranks)
    for k, name in enumerate(names):
        other = next((r for r, d in zip(ranks, got, strict=True) if int(d[k]) != int(got[0][k])), None)
        if other is not None:
            raise ValueError(
                f"FeedsAgree: feed {name!r} differs between ranks {ranks[0]} and {other} of sep group "
                f"{ranks}: every rank of a sep group must be fed the same batch (each keeps its own chunk "
                "of every sequence); feed by data-parallel rank (hcg.get_data_parallel_rank()), not by "
                "global rank"
            )
    _rt.counters[f"FeedsAgree:{_key}"] = 1  # checked and agreed: later runs only pass
    return torch.ones((), dtype=torch.bool)

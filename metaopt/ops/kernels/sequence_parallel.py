"""Megatron's three sequence-parallel collectives (passes/sequence_parallel.py inserts them).

With sequence parallel beside tensor parallel, the regions between a row-parallel layer and
the next column-parallel one (norms, dropout, residual adds) hold 1/mp of the sequence on each
rank instead of all of it, replicated:

* ``SPScatter(x)`` (Megatron's scatter_to_sequence_parallel_region): this rank's chunk of a
  replicated value along `axis`, as new storage (the whole value can be freed); backward: the
  chunks' grads all-gathered (``SPGather``).
* ``SPGather(x)`` (gather_from_sequence_parallel_region): every rank's chunk all-gathered along
  `axis`. Its backward depends on who reads the whole value (`backward`): ``"scatter"`` when
  replicated ops do (their grad is the same on every rank: keep this rank's chunk), or
  ``"reduce_scatter"`` when only column-parallel layers do (each rank's grad is a partial sum:
  sum it over the group and keep the chunk; the layer's TPCopy is then not needed).
* ``SPReduceScatter(x)`` (reduce_scatter_to_sequence_parallel_region): a row-parallel layer's
  partial product summed over the group, this rank's chunk kept; backward: all-gather.

The chunk of rank r (its place in the ascending group) is ``[r * n, (r + 1) * n)`` along `axis`,
n = the whole length / mp: contiguous, as one process's sequence; with ``layout="zigzag"``
(context parallel) it is two runs instead (`runs`). `group` is as TPReduce's
(global ranks, or ``"model_parallel"``); the rank is found at run time, so every rank's program
reads the same. A group of one is the identity.
"""

from __future__ import annotations

import torch

from metaopt.ops.kernels.partition import group_ranks
from metaopt.ops.registry import register, register_collective

BACKWARDS = ("scatter", "reduce_scatter")


def _group(op) -> list[int] | str:  # noqa: ANN001
    group = op.attrs["group"]
    return group if isinstance(group, str) else list(group)


def _layout(op) -> dict:  # noqa: ANN001
    """The op's `layout` attr, for its grad op (omitted when contiguous: the programs print as before)."""
    layout = op.attrs.get("layout", "contiguous")
    return {} if layout == "contiguous" else {"layout": layout}


def _scatter_grad(g, op, dy):
    return [g.emit1("SPGather", [dy[0]], like=op.inputs[0], axis=op.attrs["axis"], group=_group(op),
                    backward="scatter", **_layout(op))]  # fmt: skip


def _gather_grad(g, op, dy):
    kind = op.attrs.get("backward", "scatter")
    if kind not in BACKWARDS:
        raise ValueError(f"SPGather: backward must be one of {BACKWARDS}, got {kind!r}")
    to = "SPScatter" if kind == "scatter" else "SPReduceScatter"
    if kind != "scatter" and _layout(op):
        raise NotImplementedError("SPGather: a reduce-scatter backward of a zigzag layout is not built")
    return [g.emit1(to, [dy[0]], like=op.inputs[0], axis=op.attrs["axis"], group=_group(op), **_layout(op))]


def _reduce_scatter_grad(g, op, dy):
    return [g.emit1("SPGather", [dy[0]], like=op.inputs[0], axis=op.attrs["axis"], group=_group(op),
                    backward="reduce_scatter")]  # fmt: skip


def group_members(group: list[int] | str, rt, op: str) -> tuple[list[int], int] | None:  # noqa: ANN001
    """(the group's ranks, ascending; this worker's index among them), or None for a group of
    one: the identity, which runs without torch.distributed."""
    ranks = group_ranks(group, op)
    if len(ranks) == 1:
        return None
    rank = rt.comm.rank
    if rank not in ranks:
        raise ValueError(
            f"{op}: this worker (rank {rank}) is not in its group {ranks} (model-parallel or sep): the "
            "program was rewritten for another layout"
        )
    return ranks, ranks.index(rank)


def chunk(x: torch.Tensor, axis: int, parts: int, index: int) -> torch.Tensor:
    """Chunk `index` of `parts` equal ones of `x` along `axis` (a view)."""
    n = x.shape[axis]
    if n % parts:
        raise ValueError(f"sequence parallel: length {n} along axis {axis} is not divisible by {parts}")
    return x.narrow(axis, index * (n // parts), n // parts)


# Which positions of a sequence rank `index` of `parts` holds (the `layout` attr of SPScatter,
# SPGather, Dropout's slice and RingAttention): "contiguous", its chunk [index*n, (index+1)*n), or
# "zigzag" (context parallel's causal balance): runs `index` and `2*parts-1-index` of 2*parts equal
# runs, so under a causal mask every rank has as many keys to attend to as every other.
LAYOUTS = ("contiguous", "zigzag")


def runs(length: int, parts: int, index: int, layout: str = "contiguous") -> list[tuple[int, int]]:
    """(start, size) of each run of positions rank `index` of `parts` holds, in the order its
    local sequence holds them."""
    if layout not in LAYOUTS:
        raise ValueError(f"sequence layout must be one of {LAYOUTS}, got {layout!r}")
    cut = parts if layout == "contiguous" else 2 * parts
    if length % cut:
        raise ValueError(f"sequence parallel: length {length} is not divisible into {cut} runs ({layout})")
    n = length // cut
    if layout == "contiguous":
        return [(index * n, n)]
    return [(index * n, n), ((cut - 1 - index) * n, n)]


def positions(length: int, parts: int, index: int, layout: str = "contiguous") -> torch.Tensor:
    """The global positions rank `index` holds, in local order (int64)."""
    return torch.cat([torch.arange(a, a + n) for a, n in runs(length, parts, index, layout)])


def take(x: torch.Tensor, axis: int, parts: int, index: int, layout: str = "contiguous") -> torch.Tensor:
    """Rank `index`'s positions of whole `x` along `axis` (a view when they are one run)."""
    pieces = [x.narrow(axis, a, n) for a, n in runs(x.shape[axis], parts, index, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, axis)


def place(whole: torch.Tensor, axis: int, local: torch.Tensor, parts: int, index: int, layout: str) -> None:
    """Write rank `index`'s `local` values into their positions of `whole` along `axis`."""
    at = 0
    for a, n in runs(whole.shape[axis], parts, index, layout):
        whole.narrow(axis, a, n).copy_(local.narrow(axis, at, n))
        at += n


def assemble(pieces: list[torch.Tensor], axis: int, layout: str = "contiguous") -> torch.Tensor:
    """The whole value from every rank's local values (in group order) along `axis`."""
    if layout == "contiguous":
        return torch.cat(pieces, axis)
    shape = list(pieces[0].shape)
    shape[axis] *= len(pieces)
    whole = pieces[0].new_empty(shape)
    for k, piece in enumerate(pieces):
        place(whole, axis, piece, len(pieces), k, layout)
    return whole


@register(
    "SPScatter",
    domain="metaopt",
    needs_runtime=True,
    fresh_outputs=True,
    grad=_scatter_grad,
    notes="sequence parallel: this model-parallel rank's chunk along `axis` (backward: all-gather)",
)
def sp_scatter(
    x: torch.Tensor, axis: int, group: list[int] | str, _rt, _key: str, layout: str = "contiguous"
) -> torch.Tensor:
    members = group_members(group, _rt, "SPScatter")
    if members is None:
        return x.clone()
    ranks, me = members
    return take(x, axis, len(ranks), me, layout).clone(memory_format=torch.contiguous_format)


@register_collective(
    "SPGather",
    fresh_outputs=True,
    # every rank of the group runs the same program, so a recomputed gather meets its peers'
    recomputable=True,
    grad=_gather_grad,
    notes="sequence parallel: every model-parallel rank's chunk all-gathered along `axis`",
)
def sp_gather(
    x: torch.Tensor,
    axis: int,
    group: list[int] | str,
    _rt,
    _key: str,
    backward: str = "scatter",
    layout: str = "contiguous",
) -> torch.Tensor:
    members = group_members(group, _rt, "SPGather")
    if members is None:
        return x.clone()
    ranks, _ = members
    pieces = _rt.comm.all_gather(x, f"{_key} over model-parallel group {ranks}", ranks)
    return assemble(pieces, axis, layout)


@register_collective(
    "SPReduceScatter",
    fresh_outputs=True,
    recomputable=True,
    grad=_reduce_scatter_grad,
    notes="sequence parallel: a partial sum reduced over the model-parallel group, this rank's chunk kept",
)
def sp_reduce_scatter(x: torch.Tensor, axis: int, group: list[int] | str, _rt, _key: str) -> torch.Tensor:
    members = group_members(group, _rt, "SPReduceScatter")
    if members is None:
        return x.clone()
    ranks, _ = members
    parts = len(ranks)
    # the communicator scatters equal chunks of a flat buffer: lay the chunks out one after another
    flat = torch.cat([chunk(x, axis, parts, k).reshape(-1) for k in range(parts)])
    out = _rt.comm.reduce_scatter(flat, "sum", f"{_key} over model-parallel group {ranks}", ranks)
    shape = list(x.shape)
    shape[axis] //= parts
    return out.view(shape)

"""Recompute partition's two ops (passes/recompute_partition.py inserts them; Paddle's
``recompute_partition`` of its hybrid-parallel recompute).

``PartitionSlice(x)`` keeps this model-parallel rank's contiguous 1/mp of a checkpoint that
every rank of the group holds whole: ``x`` flattened, padded with zeros to a multiple of
``parts`` where needed, cut into ``parts`` equal chunks; the rank's chunk is a copy (new
storage), so once the forward's last reader of ``x`` ran the executor frees ``x`` and only
the slice is held. ``PartitionGather(slice)`` all-gathers the slices over the group (the
executor's communicator: its timeout and named errors) and puts ``x`` back, bit for bit,
in its shape, right before the segment starting at ``x`` is recomputed.

``group`` is as TPReduce's: ``"model_parallel"`` (this worker's model-parallel group of
fleet.init's hybrid layout; what fleet writes, so every worker's program reads the same) or
a list of global ranks. A rank's chunk is its index in the ascending group, the order in
which all-gather returns the slices. The rank index is found at run time, never written
into the op, so the MP ranks' programs stay identical (minimize compares them).

The memory rows: the slice var's declared shape is its 1/mp length (the pass writes it), so
`estimate_memory` and the executor's accounting both count 1/mp of the checkpoint's bytes
while the slice is held; the gathered value is counted whole from the gather on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from metaopt.ops.registry import register, register_collective


def slice_length(numel: int, parts: int) -> int:
    """Elements of each rank's slice of a value of `numel` elements: ceil(numel / parts)."""
    return -(-numel // parts)


def take_slice(x: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Chunk `index` of `parts` of `x` flattened (zero-padded at the end to equal chunks), as
    new contiguous storage (never a view of `x`: `x` must be freed)."""
    flat = x.reshape(-1)
    n = slice_length(flat.numel(), parts)
    piece = flat[index * n : (index + 1) * n]
    if piece.numel() == n:
        return piece.clone()
    out = torch.zeros(n, dtype=x.dtype, device=x.device)  # the padding of the last chunk(s)
    out[: piece.numel()] = piece
    return out


def join_slices(pieces: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """The value `take_slice` cut, from every chunk in order: `shape` holds -1 for at most one
    dim known only at run time. The padding is less than `len(pieces)` elements, and the pass
    only partitions values whose other dims hold at least that many, so the -1 dim is
    ``total // (product of the others)``."""
    full = torch.cat([p.reshape(-1) for p in pieces])
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if known < len(pieces):
            raise ValueError(
                f"PartitionGather: shape {list(shape)} has fewer than {len(pieces)} elements besides its "
                "run-time dim: the gathered length cannot say that dim"
            )
        numel = (full.numel() // known) * known
        dims = [full.numel() // known if d == -1 else d for d in shape]
    else:
        numel, dims = known, list(shape)
    if numel != full.numel():
        full = full[:numel].clone()  # drop the padding: its own storage, of the value's bytes
    return full.view(dims)


def group_ranks(group: list[int] | str, op: str) -> list[int]:
    """The global ranks of `group`, ascending ("model_parallel", "sep_parallel": this worker's group
    of fleet.init's layout, `comm.NAMED_GROUPS`)."""
    from metaopt.ops.kernels.comm import named_group_ranks

    return named_group_ranks(group, op)


def _index(ranks: list[int], parts: int, rank: int, op: str) -> int:
    if len(ranks) != parts or rank not in ranks:
        raise ValueError(
            f"{op}: this worker (rank {rank}) with parts={parts} is not one of {parts} ranks of its "
            f"model-parallel group {ranks}: the program was rewritten for another layout"
        )
    return ranks.index(rank)


@register(
    "PartitionSlice",
    domain="metaopt",
    needs_runtime=True,
    fresh_outputs=True,
    recomputable=False,  # its slice is what the backward gathers: made once, in the forward
    notes="recompute partition: this MP rank's contiguous 1/parts of x flattened (zero-padded)",
)
def partition_slice(x: torch.Tensor, group: list[int] | str, parts: int, _rt, _key: str) -> torch.Tensor:
    ranks = group_ranks(group, "PartitionSlice")
    return take_slice(x, parts, _index(ranks, parts, _rt.comm.rank, "PartitionSlice"))


@register_collective(
    "PartitionGather",
    fresh_outputs=True,
    recomputable=False,
    notes="recompute partition: every MP rank's slice all-gathered, the checkpoint back in `shape`",
)
def partition_gather(
    s: torch.Tensor, group: list[int] | str, parts: int, shape: list[int], _rt, _key: str
) -> torch.Tensor:
    ranks = group_ranks(group, "PartitionGather")
    _index(ranks, parts, _rt.comm.rank, "PartitionGather")
    pieces = _rt.comm.all_gather(s, f"{_key} over model-parallel group {ranks}", ranks)
    return join_slices(pieces, shape)

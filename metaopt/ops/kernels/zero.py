"""ZeRO sharding's three collectives (passes/sharding.py inserts them).

Each works on the flat layout of `metaopt.ir.ZeroShard` (the one recompute partition's
slices have too: ``take_slice`` / ``join_slices``): a tensor flattened, zero-padded to
``parts`` equal chunks, worker i of the sharding group holding chunk i.

* ``ShardSlice(x, ...)``: this worker's chunk of each input (new storage). No communication:
  stage 1 takes its part of grads every worker holds whole after the all-reduce, and of the
  param it updates.
* ``ReduceScatter(g, ...)``: the grads averaged over the group, each worker getting only its
  chunk of each (stage 2: the whole grad dies right there). One collective per op: row r of
  its buffer is chunk r of every grad, so a bucket of grads is one ``reduce_scatter``.
* ``ShardGather(s, ..., ndims=[...], dims=[...])``: every worker's chunks of each input, the
  tensors back whole in their shapes (the updated params, after the sharded update). One
  all-gather per op (a bucket of ``segment_broadcast_MB``).
* ``ShardedClipByGlobalNorm(s, ...)``: ``ClipByGlobalNorm`` on grads held as slices: the squared
  norms of this worker's slices summed, all-reduced over the group (the padding adds zero),
  the coefficient applied to each slice.

``group="sharding"`` is this worker's sharding group of fleet.init's hybrid layout, or every
worker when fleet.init laid out no hybrid groups (sharding over the whole job). The chunk a
worker holds is its index in the ascending group, found at run time, so every worker's
program reads the same (minimize compares them).
"""

from __future__ import annotations

import math

import torch

from metaopt.ops.kernels.partition import join_slices, slice_length, take_slice
from metaopt.ops.registry import register, register_collective


def sharding_ranks(group: str, parts: int, rt, op: str) -> tuple[list[int], int]:
    """(the global ranks of this worker's sharding group, ascending; this worker's index in it).
    A group of one is this process alone, with or without torch.distributed."""
    if group != "sharding":
        raise ValueError(f"{op}: group must be 'sharding', got {group!r}")
    if parts == 1:  # nothing to find: never start torch.distributed for it
        return [], 0
    rank, world_size = rt.comm.rank, rt.comm.world_size
    from metaopt.layout.groups import axis_ranks

    ranks = axis_ranks("sharding") or list(range(world_size))
    if len(ranks) != parts or rank not in ranks:
        raise ValueError(
            f"{op}: this worker (rank {rank}) with parts={parts} is not one of {parts} ranks of its "
            f"sharding group {ranks}: the program was rewritten for another sharding_degree"
        )
    return ranks, ranks.index(rank)


@register(
    "ShardSlice",
    domain="metaopt",
    needs_runtime=True,
    fresh_outputs=True,
    recomputable=False,
    notes="ZeRO: this worker's flat 1/parts of each input (zero-padded), as new storage",
)
def shard_slice(*xs: torch.Tensor, group: str, parts: int, _rt, _key: str) -> tuple[torch.Tensor, ...]:
    _, index = sharding_ranks(group, parts, _rt, "ShardSlice")
    return tuple(take_slice(x, parts, index) for x in xs)


@register_collective(
    "ReduceScatter",
    fresh_outputs=True,
    recomputable=False,
    wait_op="CommWait",
    staged_shape=lambda op, declared: (op.attrs["parts"], sum(declared[o].shape[0] for o in op.outputs)),
    notes="ZeRO stage 2: each input averaged over the sharding group, this worker keeping its 1/parts",
)
def reduce_scatter(
    *xs: torch.Tensor, group: str, parts: int, reduce: str = "avg", overlap: int = 0, _rt, _key: str
) -> tuple[torch.Tensor, ...]:
    """``overlap=1`` (passes/overlap_comm.py): the slices are in flight until their ``CommWait``,
    and the rows it sends (the bucket's grads, chunk r of each in row r) are one more output,
    held until then."""
    ranks, _ = sharding_ranks(group, parts, _rt, "ReduceScatter")
    lengths = [slice_length(x.numel(), parts) for x in xs]
    what = f"{len(xs)} grad(s) ({_key}, ...)"
    if parts > 1 and not overlap:  # row by row: the whole buffer never exists (`reduce_scatter_rows`)
        mine = _rt.comm.reduce_scatter_rows(lambda j: chunk_row(xs, lengths, parts, j), reduce, what, ranks)
        return tuple(mine.split(lengths))
    rows = torch.stack([chunk_row(xs, lengths, parts, j) for j in range(parts)])
    if parts == 1:
        if not overlap:
            return tuple(rows[0].split(lengths))
        outs = tuple(rows[0].clone().split(lengths))
        _rt.comm.done_without_comm(outs)
        return (*outs, rows)
    mine = _rt.comm.reduce_scatter(rows.reshape(-1), reduce, what, ranks, overlap=True)
    return (*mine.split(lengths), rows)


def chunk_row(xs: tuple[torch.Tensor, ...], lengths: list[int], parts: int, j: int) -> torch.Tensor:
    """Chunk `j` of `parts` of each of `xs` flattened (`take_slice`'s layout: `lengths[i]`
    elements each, the end zero-padded), one after another, as new storage."""
    row = torch.empty(sum(lengths), dtype=xs[0].dtype, device=xs[0].device)
    at = 0
    for x, n in zip(xs, lengths, strict=True):
        piece = x.reshape(-1)[j * n : (j + 1) * n]
        row[at : at + piece.numel()] = piece
        row[at + piece.numel() : at + n] = 0
        at += n
    return row


@register_collective(
    "ShardGather",
    state_from_updates=True,  # the updated slices: on a skipped step, the old ones
    fresh_outputs=True,
    recomputable=False,
    notes="ZeRO: every worker's 1/parts of each input all-gathered, the tensors whole in their shapes",
)
def shard_gather(
    *slices: torch.Tensor, group: str, parts: int, ndims: list[int], dims: list[int], _rt, _key: str
) -> tuple[torch.Tensor, ...]:
    """`ndims[i]` dims of `dims` (all the shapes, one after the other: ONNX attributes hold no
    nested lists) are output i's shape."""
    ranks, _ = sharding_ranks(group, parts, _rt, "ShardGather")
    shapes = _unflatten(ndims, dims)
    if len(shapes) != len(slices):
        raise ValueError(f"ShardGather: {len(slices)} inputs but {len(shapes)} shapes (ndims={ndims})")
    if parts == 1:
        return tuple(join_slices([s], shape) for s, shape in zip(slices, shapes, strict=True))
    # each tensor whole in its own storage, every worker's chunk received in place (the
    # padding of the last chunks dropped as it lands): no second copy of the gathered values
    numels = [_numel(shape, parts * s.numel()) for s, shape in zip(slices, shapes, strict=True)]
    wholes = [torch.empty(n, dtype=s.dtype, device=s.device) for s, n in zip(slices, numels, strict=True)]
    dests = [
        [w[j * s.numel() : (j + 1) * s.numel()] for w, s in zip(wholes, slices, strict=True)]
        for j in range(parts)
    ]
    _rt.comm.all_gather_pieces(
        [s.reshape(-1) for s in slices], dests, f"{len(slices)} param slice(s) ({_key}, ...)", ranks
    )
    return tuple(w.view(_dims(shape, n)) for w, shape, n in zip(wholes, shapes, numels, strict=True))


def _numel(shape: list[int], total: int) -> int:
    """The elements of a value of `shape` whose padded chunks hold `total` (`join_slices`'s
    rule for a -1 dim known only at run time)."""
    known = math.prod(d for d in shape if d != -1)
    return (total // known) * known if -1 in shape else known


def _dims(shape: list[int], numel: int) -> list[int]:
    known = math.prod(d for d in shape if d != -1)
    return [numel // known if d == -1 else d for d in shape]


def flatten_shapes(shapes: list[list[int]]) -> dict[str, list[int]]:
    """ShardGather's ``ndims`` and ``dims`` attrs of the outputs' `shapes`."""
    return {"ndims": [len(s) for s in shapes], "dims": [d for s in shapes for d in s]}


def _unflatten(ndims: list[int], dims: list[int]) -> list[list[int]]:
    if sum(ndims) != len(dims) or min(ndims, default=0) < 0:
        raise ValueError(f"ShardGather: ndims={ndims} does not cut dims={dims}")
    out, at = [], 0
    for n in ndims:
        out.append(list(dims[at : at + n]))
        at += n
    return out


@register_collective(
    "ShardedClipByGlobalNorm",
    needs_outputs=True,
    recomputable=False,
    fresh_outputs=True,
    notes="ZeRO: global-norm clipping of grads held as 1/parts slices (one all-reduce of the squared norm)",
)
def sharded_clip_by_global_norm(
    *slices: torch.Tensor, clip_norm: float = 1.0, group: str, parts: int, _nout: int = 1, _rt, _key: str
):
    """`ClipByGlobalNorm`'s coefficient from every worker's slices: the whole grads' norm is the
    root of the summed squares of the slices' (the same value; its float rounding differs from
    torch's per-tensor norms)."""
    ranks, _ = sharding_ranks(group, parts, _rt, "ShardedClipByGlobalNorm")
    if len(slices) != _nout:
        raise ValueError(f"ShardedClipByGlobalNorm: {len(slices)} grads in but {_nout} outputs")
    norms = torch.stack([torch.linalg.vector_norm(s, 2.0, dtype=torch.float32) for s in slices])
    square = norms.square().sum()
    if parts > 1:
        (square,) = _rt.comm.all_reduce(
            [square], "sum", f"the squared norm of {len(slices)} grads ({_key})", ranks
        )
    coef = torch.clamp(float(clip_norm) / (square.sqrt() + 1e-6), max=1.0)
    out = tuple(s.mul(coef.to(s.dtype)) for s in slices)
    return out[0] if _nout == 1 else out

"""Indexing ops: gathers, scatters, one-hot, non-zero, compress, sequence reversal, unique.

Index operands are moved to the data's device (a no-op when they are already there), and
negative indices count from the end as ONNX allows.
"""

from __future__ import annotations

import math

import torch

from metaopt.ops import onnx_bodies
from metaopt.ops.registry import SAME, ShapeArgs, register


def _fix_negative(indices: torch.Tensor, n) -> torch.Tensor:
    return torch.where(indices < 0, indices + n, indices)


def _shape_value_of_gather(a: ShapeArgs) -> tuple[list, bool] | None:
    """Picking dims of a tracked shape value (passes/fold_constants.py): axis 0, known indices."""
    if a.tracked[0] is None or a.attrs.get("axis", 0) != 0 or a.values[1] is None:
        return None
    idx, scalar = a.values[1]
    return [a.tracked[0][0][i] for i in idx], scalar


def _scalar_index(op, shapes: list) -> bool:  # noqa: ANN001
    return len(shapes) > 1 and shapes[1] is not None and len(shapes[1]) == 0


def _scalar_index_on_host(op, program) -> tuple[int, ...]:  # noqa: ANN001
    """A 0-d index is read as a Python int (a view, below): from the host, where a constant has
    its mirror and shape arithmetic computes, so no device value is read; any other index stays
    on the device (a constant one is not uploaded again every step)."""
    v = program.vars.get(op.inputs[1]) if len(op.inputs) > 1 else None
    return (1,) if v is not None and v.shape == () else ()


# a scalar index on the CPU: a view (`view_if`: memory estimates count no new storage)
@register(
    "Gather",
    aliases=SAME,
    shape_value=_shape_value_of_gather,
    view_if=_scalar_index,
    host_inputs=_scalar_index_on_host,
)
def gather(data: torch.Tensor, indices: torch.Tensor, axis: int = 0) -> torch.Tensor:
    if indices.dim() == 0 and indices.device.type == "cpu":
        return data.select(axis, int(indices))  # a view; python-int indexing handles negatives
    # Advanced indexing is exactly ONNX Gather: negative indices count from the end, the
    # output shape is data.shape[:axis] + indices.shape + data.shape[axis + 1:], and an index
    # tensor on another device is accepted. It is also cheaper than index_select + reshape.
    if axis == 0:
        return data[indices]
    return data[(slice(None),) * (axis % data.dim()) + (indices,)]


@register("Embedding", domain="metaopt", onnx_function=onnx_bodies.embedding)
def embedding(
    weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: int = 0
):
    """torch's F.embedding: Gather(weight, indices, axis=0) forward; the attrs shape only the
    weight's grad (the row's rule hands them to EmbeddingGrad)."""
    return torch.nn.functional.embedding(indices.to(device=weight.device), weight)


@register("GatherElements")
def gather_elements(data: torch.Tensor, indices: torch.Tensor, axis: int = 0) -> torch.Tensor:
    idx = _fix_negative(indices.to(device=data.device, dtype=torch.int64), data.shape[axis])
    return torch.gather(data, axis, idx)


def _nd_index(data: torch.Tensor, indices: torch.Tensor, batch_dims: int) -> tuple[torch.Tensor, ...]:
    """Advanced-indexing tuple for GatherND/ScatterND (batch dims become aranges)."""
    k = indices.shape[-1]
    idx = indices.to(device=data.device, dtype=torch.int64)
    dims = torch.tensor(data.shape[batch_dims : batch_dims + k], device=data.device)
    idx = _fix_negative(idx, dims)
    lead = []
    for b in range(batch_dims):
        shape = [1] * (indices.dim() - 1)
        shape[b] = data.shape[b]
        lead.append(torch.arange(data.shape[b], device=data.device).reshape(shape))
    return (*lead, *idx.unbind(-1))


@register("GatherND")
def gather_nd(data: torch.Tensor, indices: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    return data[_nd_index(data, indices, batch_dims)]


@register("GatherNDGrad", domain="metaopt", fresh_outputs=True)
def gather_nd_grad(
    dy: torch.Tensor,
    indices: torch.Tensor,
    data: torch.Tensor | None = None,
    sizes: list[int] | None = None,
    batch_dims: int = 0,
) -> torch.Tensor:
    """GatherND's grad: `dy` summed into zeros of the data's shape (`sizes`, or the shape of
    `data` where a dim is symbolic) at the gathered places, as torch's index backward
    (index_put with accumulate: repeated indices add)."""
    out = dy.new_zeros(sizes if data is None else data.shape)
    return out.index_put_(_nd_index(out, indices, batch_dims), dy, accumulate=True)


# ONNX scatter reduction names -> torch scatter_reduce names.
_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter_elements(
    data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor, axis: int = 0, reduction: str = "none"
) -> torch.Tensor:
    idx = _fix_negative(indices.to(device=data.device, dtype=torch.int64), data.shape[axis])
    if reduction == "none":
        return torch.scatter(data, axis, idx, updates)
    return torch.scatter_reduce(data, axis, idx, updates, _REDUCE[reduction], include_self=True)


register("ScatterElements")(_scatter_elements)
register("Scatter")(_scatter_elements)  # the pre-opset-11 name of the same op


@register("ScatterND")
def scatter_nd(
    data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor, reduction: str = "none"
) -> torch.Tensor:
    index = _nd_index(data, indices, 0)
    out = data.clone()
    if reduction == "none":
        return out.index_put_(index, updates)
    if reduction == "add":
        return out.index_put_(index, updates, accumulate=True)
    # mul/max/min: scatter_reduce over the flattened indexed prefix.
    k = indices.shape[-1]
    flat = torch.zeros((), dtype=torch.int64, device=data.device)
    for i, ix in enumerate(index):
        flat = flat * data.shape[i] + ix
    rows = out.reshape(math.prod(data.shape[:k]), -1)
    upd = updates.reshape(-1, rows.shape[1])
    rows.scatter_reduce_(0, flat.reshape(-1, 1).expand_as(upd), upd, _REDUCE[reduction], include_self=True)
    return out


@register("OneHot", host_inputs=(1,))
def one_hot(indices: torch.Tensor, depth: torch.Tensor, values: torch.Tensor, axis: int = -1) -> torch.Tensor:
    d = int(depth)
    rank = indices.dim() + 1
    if axis < 0:
        axis += rank
    idx = indices.to(torch.int64)
    idx = torch.where(idx < 0, idx + d, idx).unsqueeze(axis)
    # A comparison, not F.one_hot: out-of-range indices give an all-`off` row as ONNX wants.
    classes = torch.arange(d, device=indices.device).reshape([d if i == axis else 1 for i in range(rank)])
    return torch.where(idx == classes, values[1], values[0])


@register("NonZero")
def non_zero(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return torch.zeros((0, int(bool(x))), dtype=torch.int64, device=x.device)
    return torch.nonzero(x).t()


@register("Compress")
def compress(input: torch.Tensor, condition: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    keep = torch.nonzero(condition.to(device=input.device, dtype=torch.bool)).reshape(-1)
    if axis is None:
        flat = input.reshape(-1)
        return flat.index_select(0, keep[keep < flat.numel()])
    return input.index_select(axis, keep)


@register("ReverseSequence")
def reverse_sequence(
    input: torch.Tensor, sequence_lens: torch.Tensor, batch_axis: int = 1, time_axis: int = 0
) -> torch.Tensor:
    t = input.shape[time_axis]
    steps = torch.arange(t, device=input.device)
    lens = sequence_lens.to(device=input.device, dtype=torch.int64)
    # source time index per (time, batch): reversed inside the length, identity beyond it
    src = torch.where(steps[:, None] < lens[None, :], lens[None, :] - 1 - steps[:, None], steps[:, None])
    if time_axis > batch_axis:
        src = src.t()
    shape = [1] * input.dim()
    shape[time_axis], shape[batch_axis] = t, input.shape[batch_axis]
    return torch.gather(input, time_axis, src.reshape(shape).expand(input.shape))


@register("Unique", needs_outputs=True)
def unique(X: torch.Tensor, axis: int | None = None, sorted: int = 1, _nout: int = 1):
    x = X.reshape(-1) if axis is None else X
    dim = 0 if axis is None else axis
    y, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True, dim=dim)
    n = x.shape[dim]
    # First occurrence of each unique value: the smallest position mapping to it.
    first = torch.full((y.shape[dim],), n, dtype=torch.int64, device=x.device)
    first = first.scatter_reduce(0, inverse, torch.arange(n, device=x.device), "amin")
    if not sorted:  # ONNX's unsorted order is the order of first occurrence
        order = torch.argsort(first)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        y, first, counts, inverse = y.index_select(dim, order), first[order], counts[order], rank[inverse]
    return (y, first, inverse, counts)[:_nout] if _nout > 1 else y


@register("TensorScatter")
def tensor_scatter(
    past_cache: torch.Tensor,
    update: torch.Tensor,
    write_indices: torch.Tensor | None = None,
    axis: int = -2,
    mode: str = "linear",
) -> torch.Tensor:
    axis %= past_cache.dim()
    batch, steps, length = update.shape[0], update.shape[axis], past_cache.shape[axis]
    start = (
        write_indices.to(device=past_cache.device, dtype=torch.int64)
        if write_indices is not None
        else torch.zeros(batch, dtype=torch.int64, device=past_cache.device)
    )
    pos = start.reshape(-1, 1) + torch.arange(steps, device=past_cache.device)  # (batch, steps)
    if mode == "circular":
        pos = pos.remainder(length)
    shape = [1] * update.dim()
    shape[0], shape[axis] = batch, steps
    index = pos.reshape(shape).expand(update.shape)
    return torch.scatter(past_cache, axis, index, update)

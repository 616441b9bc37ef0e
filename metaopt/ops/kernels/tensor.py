"""Shape, indexing and data-movement ops.

Shape-like int64 operands (Reshape's shape, Slice's starts, axes, pads, ...) are read with
``.tolist()``: they may sit on the CPU while the data is on the device. Shape and Size
produce such tensors on the CPU, so shape arithmetic never round-trips through the device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from metaopt.frontend.attrs import torch_dtype
from metaopt.ops.registry import register


def _ints(v) -> list[int]:
    """A shape-like operand (int64 tensor, or a list attribute) as a list of ints."""
    return v.tolist() if isinstance(v, torch.Tensor) else list(v)


@register("Identity")
def identity(input: torch.Tensor) -> torch.Tensor:
    return input


@register("Shape")
def shape(data: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
    return torch.tensor(data.shape[start:end], dtype=torch.int64)


@register("Size")
def size(data: torch.Tensor) -> torch.Tensor:
    return torch.tensor(data.numel(), dtype=torch.int64)


@register("Reshape")
def reshape(data: torch.Tensor, shape: torch.Tensor, allowzero: int = 0) -> torch.Tensor:
    dims = shape.tolist()
    if not allowzero and 0 in dims:
        # ONNX: a 0 copies the input's dim at that position (unless allowzero).
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return data.reshape(dims)


@register("Flatten")
def flatten(x: torch.Tensor, axis: int = 1) -> torch.Tensor:
    if axis < 0:
        axis += x.dim()
    outer = math.prod(x.shape[:axis])
    return x.reshape(outer, math.prod(x.shape[axis:]))


@register("Squeeze")
def squeeze(data: torch.Tensor, axes=None) -> torch.Tensor:
    if axes is None:
        return data.squeeze()
    return data.squeeze(tuple(_ints(axes)))


@register("Unsqueeze")
def unsqueeze(data: torch.Tensor, axes) -> torch.Tensor:
    axes = _ints(axes)
    if len(axes) == 1:
        return data.unsqueeze(axes[0])
    rank = data.dim() + len(axes)
    # Axes index the output; inserting them in ascending order keeps each one valid.
    for a in sorted(a % rank for a in axes):
        data = data.unsqueeze(a)
    return data


@register("Concat")
def concat(*inputs: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.cat(inputs, axis)


@register("Split", needs_outputs=True)
def split(
    input: torch.Tensor, split=None, axis: int = 0, num_outputs: int | None = None, _nout: int = 1
) -> tuple[torch.Tensor, ...]:
    if split is not None:
        sizes = _ints(split)
        if sizes:
            return torch.split(input, sizes, axis)
    n = input.shape[axis]
    parts = num_outputs or _nout
    # ONNX: equal chunks of ceil(n / parts), the last one smaller.
    return torch.split(input, -(-n // parts), axis)


_INT64_MAX = 2**63 - 1


@register("Slice")
def slice_(data: torch.Tensor, starts, ends, axes=None, steps=None) -> torch.Tensor:
    # Inputs since opset 10; the same names as attributes (lists, no steps) before.
    starts, ends = _ints(starts), _ints(ends)
    axes = _ints(axes) if axes is not None else range(len(starts))
    steps = _ints(steps) if steps is not None else None
    index = [slice(None)] * data.dim()
    flips = []
    for i, ax in enumerate(axes):
        step = steps[i] if steps is not None else 1
        start, end = starts[i], ends[i]
        if step > 0:
            index[ax] = slice(start, end, step)  # Python slicing clamps exactly as ONNX does
            continue
        # torch has no negative steps: slice the flipped dim with the mirrored bounds.
        n = data.shape[ax]
        start = min(max(start + n if start < 0 else start, -1), n - 1)
        end = min(max(end + n if end < 0 else end, -1), n - 1)
        index[ax] = slice(n - 1 - start, n - 1 - end, -step)
        flips.append(ax)
    if flips:
        data = data.flip(flips)
    return data[tuple(index)]


@register("Expand")
def expand(input: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    # ONNX Expand broadcasts both ways (a 1 in `shape` keeps the input's dim), torch's does not.
    return input.expand(torch.broadcast_shapes(input.shape, shape.tolist()))


@register("Tile")
def tile(input: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
    return input.repeat(repeats.tolist())


@register("Transpose")
def transpose(data: torch.Tensor, perm: list[int] | None = None) -> torch.Tensor:
    if perm is None:
        return data.permute(*range(data.dim() - 1, -1, -1))
    return data.permute(perm)


@register("Cast")
def cast(input: torch.Tensor, to: int, saturate: int = 1, round_mode: str = "up") -> torch.Tensor:
    # saturate/round_mode only concern float8/float4 targets, which torch_dtype refuses.
    return input.to(torch_dtype(to, what="Cast"))


@register("CastLike")
def cast_like(
    input: torch.Tensor, target_type: torch.Tensor, saturate: int = 1, round_mode: str = "up"
) -> torch.Tensor:
    return input.to(target_type.dtype)


@register("Constant", needs_device=True)
def constant(
    value: torch.Tensor | None = None,
    value_float: float | None = None,
    value_floats: list[float] | None = None,
    value_int: int | None = None,
    value_ints: list[int] | None = None,
    _device: torch.device | None = None,
) -> torch.Tensor:
    if value is not None:
        return value.to(_device)
    if value_float is not None:
        return torch.tensor(value_float, dtype=torch.float32, device=_device)
    if value_floats is not None:
        return torch.tensor(value_floats, dtype=torch.float32, device=_device)
    if value_int is not None:
        return torch.tensor(value_int, dtype=torch.int64, device=_device)
    if value_ints is not None:
        return torch.tensor(value_ints, dtype=torch.int64, device=_device)
    raise NotImplementedError("Constant: only value, value_float(s) and value_int(s) are supported")


@register("ConstantOfShape", needs_device=True)
def constant_of_shape(
    input: torch.Tensor, value: torch.Tensor | None = None, _device: torch.device | None = None
) -> torch.Tensor:
    dims = input.tolist()
    if value is None:
        return torch.zeros(dims, dtype=torch.float32, device=_device)
    return torch.full(dims, value.item(), dtype=value.dtype, device=_device)


@register("Range", needs_device=True)
def range_(
    start: torch.Tensor, limit: torch.Tensor, delta: torch.Tensor, _device: torch.device | None = None
) -> torch.Tensor:
    s, lim, d = start.item(), limit.item(), delta.item()
    if start.is_floating_point():
        # ONNX fixes the count as ceil((limit - start) / delta) and the values as start + i * delta.
        n = max(math.ceil((lim - s) / d), 0)
        return (torch.arange(n, dtype=torch.float64, device=_device) * d + s).to(start.dtype)
    return torch.arange(s, lim, d, dtype=start.dtype, device=_device)


@register("Trilu")
def trilu(input: torch.Tensor, k: torch.Tensor | None = None, upper: int = 1) -> torch.Tensor:
    diag = int(k) if k is not None else 0
    return torch.triu(input, diag) if upper else torch.tril(input, diag)


def _pad_index(n: int, before: int, after: int, mode: str, device: torch.device) -> torch.Tensor:
    """Source positions for every output position of one padded dim (non-constant modes)."""
    idx = torch.arange(-before, n + after, device=device)
    if mode == "edge":
        return idx.clamp(0, n - 1)
    if mode == "wrap":
        return idx.remainder(n)
    # reflect: mirror without repeating the edge, period 2(n - 1)
    period = 2 * (n - 1)
    if period == 0:
        return torch.zeros_like(idx)
    idx = idx.remainder(period)
    return torch.where(idx >= n, period - idx, idx)


@register("Pad")
def pad(
    data: torch.Tensor,
    pads=None,
    constant_value: torch.Tensor | None = None,
    axes=None,
    mode: str = "constant",
    value: float = 0.0,
) -> torch.Tensor:
    # pads/value are inputs since opset 11, attributes before.
    p = _ints(pads)
    rank = data.dim()
    axes = [a % rank for a in _ints(axes)] if axes is not None else list(range(rank))
    k = len(axes)
    if mode == "constant":
        fill = constant_value.item() if constant_value is not None and constant_value.numel() else value
        # F.pad wants (last dim begin, end, previous dim begin, end, ...).
        tp = [0] * (2 * rank)
        for i, ax in enumerate(axes):
            j = 2 * (rank - 1 - ax)
            tp[j], tp[j + 1] = p[i], p[i + k]
        while len(tp) > 2 and tp[-1] == 0 and tp[-2] == 0:
            tp = tp[:-2]
        return F.pad(data, tp, value=fill)
    out = data
    for i, ax in enumerate(axes):
        before, after = p[i], p[i + k]
        if before or after:
            out = out.index_select(ax, _pad_index(out.shape[ax], before, after, mode, out.device))
    return out


def _fix_negative(indices: torch.Tensor, n) -> torch.Tensor:
    return torch.where(indices < 0, indices + n, indices)


@register("Gather")
def gather(data: torch.Tensor, indices: torch.Tensor, axis: int = 0) -> torch.Tensor:
    if axis < 0:
        axis += data.dim()
    n = data.shape[axis]
    if indices.dim() == 0 and indices.device.type == "cpu":
        return data.select(axis, int(indices))  # a view; python-int indexing handles negatives
    idx = _fix_negative(indices.to(device=data.device, dtype=torch.int64), n)
    if axis == 0 and data.dim() == 2 and data.is_floating_point():
        return F.embedding(idx, data)  # the embedding fast path (and torch's own op for it)
    out = data.index_select(axis, idx.reshape(-1))
    return out.reshape(data.shape[:axis] + idx.shape + data.shape[axis + 1 :])


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


@register("OneHot")
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


@register("EyeLike")
def eye_like(input: torch.Tensor, dtype: int | None = None, k: int = 0) -> torch.Tensor:
    out_dtype = torch_dtype(dtype, what="EyeLike") if dtype is not None else input.dtype
    out = torch.zeros(input.shape, dtype=out_dtype, device=input.device)
    out.diagonal(k).fill_(1)  # a fresh tensor: filling it in place is safe
    return out


@register("DepthToSpace")
def depth_to_space(input: torch.Tensor, blocksize: int, mode: str = "DCR") -> torch.Tensor:
    n, c, h, w = input.shape
    b = blocksize
    if mode == "DCR":
        x = input.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:  # CRD
        x = input.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(n, c // (b * b), h * b, w * b)


@register("SpaceToDepth")
def space_to_depth(input: torch.Tensor, blocksize: int, mode: str = "DCR") -> torch.Tensor:
    n, c, h, w = input.shape
    b = blocksize
    x = input.reshape(n, c, h // b, b, w // b, b)
    x = x.permute(0, 3, 5, 1, 2, 4) if mode == "DCR" else x.permute(0, 1, 3, 5, 2, 4)
    return x.reshape(n, c * b * b, h // b, w // b)


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

"""Shape and data-movement ops, casts, and the ops that create tensors.

Shape-like int64 operands (Reshape's shape, Slice's starts, axes, pads, ...) are read with
``.tolist()``: they may sit on the CPU while the data is on the device. Shape and Size
produce such tensors on the CPU, so shape arithmetic never round-trips through the device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from metaopt.ir.dtypes import torch_dtype_from_onnx
from metaopt.ops.kernels.rotary import fuse_rotary
from metaopt.ops.registry import ALL, SAME, ShapeArgs, register


def _ints(v) -> list[int]:
    """A shape-like operand (int64 tensor, or a list attribute) as a list of ints."""
    return v.tolist() if isinstance(v, torch.Tensor) else list(v)


@register("Identity", aliases=SAME, view=True)
def identity(input: torch.Tensor) -> torch.Tensor:
    return input


# --- shape-value rules (the rows' `shape_value`, passes/fold_constants.py) ---------------------
# A shape value is (dims, is_scalar): the dims an int64 shape tensor holds, ints or symbols such
# as "batch". The propagating rules apply only to an input 0 already tracked as one (with
# symbolic dims): an all-constant op is folded by running its kernel.


def _shape_value_of_shape(a: ShapeArgs) -> tuple[list, bool] | None:
    shape = a.shapes[0]
    if shape is None:
        return None
    start, end = a.attrs.get("start", 0), a.attrs.get("end", len(shape))
    return list(shape)[slice(start, end)], False


def _shape_value_of_size(a: ShapeArgs) -> tuple[list, bool] | None:
    shape = a.shapes[0]
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return [math.prod(shape)], True


def _shape_value_of_slice(a: ShapeArgs) -> tuple[list, bool] | None:
    if a.tracked[0] is None or not all(x is not None for x in a.values[1:]):
        return None
    starts, ends = a.values[1][0], a.values[2][0]
    step = a.values[4][0][0] if len(a.values) > 4 else 1
    if len(starts) != 1:
        return None
    return a.tracked[0][0][slice(starts[0], ends[0], step)], False


def _shape_value_of_concat(a: ShapeArgs) -> tuple[list, bool] | None:
    if a.tracked[0] is None or not all(x is not None and not x[1] for x in a.values):
        return None
    return [d for x in a.values for d in x[0]], False


def _shape_value_of_squeeze(a: ShapeArgs) -> tuple[list, bool] | None:
    if a.tracked[0] is None or len(a.tracked[0][0]) != 1:
        return None
    return a.tracked[0][0], True


def _shape_value_of_unsqueeze(a: ShapeArgs) -> tuple[list, bool] | None:
    if a.tracked[0] is None or len(a.tracked[0][0]) != 1:
        return None
    return a.tracked[0][0], False


# --- static targets (the rows' `static_target`, passes/fold_constants.py) ------------------------


def _static_reshape_target(attrs: dict, out: tuple, src: tuple | None) -> tuple[list[int], dict] | None:
    """-1 where the output has its one symbolic dim (allowzero off: the target has no 0)."""
    sym = [i for i, d in enumerate(out) if isinstance(d, str)]
    if len(sym) != 1 or (attrs.get("allowzero", 0) and 0 in out):
        return None
    return [-1 if isinstance(d, str) else d for d in out], {"allowzero": 0}


def _static_expand_target(attrs: dict, out: tuple, src: tuple | None) -> tuple[list[int], dict] | None:
    """1 (keep the input's dim) where a symbolic output dim comes from the input."""
    if src is None:
        return None
    aligned = [None] * (len(out) - len(src)) + list(src)
    target = []
    for d, s in zip(out, aligned, strict=True):
        if isinstance(d, str):
            if d != s:
                return None
            target.append(1)
        else:
            target.append(d)
    return target, {}


@register("Shape", host_outputs=True, shape_value=_shape_value_of_shape)
def shape(data: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
    return torch.tensor(data.shape[start:end], dtype=torch.int64)


@register("Size", host_outputs=True, shape_value=_shape_value_of_size)
def size(data: torch.Tensor) -> torch.Tensor:
    return torch.tensor(data.numel(), dtype=torch.int64)


@register("Reshape", host_inputs=(1,), aliases=SAME, view=True, static_target=_static_reshape_target)
def reshape(data: torch.Tensor, shape: torch.Tensor, allowzero: int = 0) -> torch.Tensor:
    dims = shape.tolist()
    if not allowzero and 0 in dims:
        # ONNX: a 0 copies the input's dim at that position (unless allowzero).
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return data.reshape(dims)


@register("Flatten", aliases=SAME, view=True)
def flatten(x: torch.Tensor, axis: int = 1) -> torch.Tensor:
    if axis < 0:
        axis += x.dim()
    outer = math.prod(x.shape[:axis])
    return x.reshape(outer, math.prod(x.shape[axis:]))


@register("Squeeze", host_inputs=(1,), aliases=SAME, view=True, shape_value=_shape_value_of_squeeze)
def squeeze(data: torch.Tensor, axes=None) -> torch.Tensor:
    if axes is None:
        return data.squeeze()
    return data.squeeze(tuple(_ints(axes)))


@register("Unsqueeze", host_inputs=(1,), aliases=SAME, view=True, shape_value=_shape_value_of_unsqueeze)
def unsqueeze(data: torch.Tensor, axes) -> torch.Tensor:
    axes = _ints(axes)
    if len(axes) == 1:
        return data.unsqueeze(axes[0])
    rank = data.dim() + len(axes)
    # Axes index the output; inserting them in ascending order keeps each one valid.
    for a in sorted(a % rank for a in axes):
        data = data.unsqueeze(a)
    return data


# Concat anchors the rotary embedding's rotate_half (ops/kernels/rotary.py)
@register("Concat", shape_value=_shape_value_of_concat, fuse=fuse_rotary)
def concat(*inputs: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.cat(inputs, axis)


@register("Split", needs_outputs=True, host_inputs=(1,), aliases=((ALL, 0),), view=True)
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


@register("Slice", host_inputs=(1, 2, 3, 4), aliases=SAME, view=True, shape_value=_shape_value_of_slice)
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
        start = min(max(start + n if start < 0 else start, 0), n - 1)
        end = min(max(end + n if end < 0 else end, -1), n - 1)
        index[ax] = slice(n - 1 - start, n - 1 - end, -step)
        flips.append(ax)
    if not flips:
        return data[tuple(index)]
    out = data.flip(flips)[tuple(index)]  # a view of a whole flipped copy: keep only the part
    return out.clone() if out.numel() < data.numel() else out


@register("Expand", host_inputs=(1,), aliases=SAME, view=True, static_target=_static_expand_target)
def expand(input: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    # ONNX Expand broadcasts both ways: a 1 in `shape` keeps the input's dim (torch's -1), and
    # `shape` may have fewer dims than the input. (torch.broadcast_shapes costs ~8 us a call.)
    dims = shape.tolist()
    rank = input.dim()
    if len(dims) < rank:
        dims = [1] * (rank - len(dims)) + dims
    lead = len(dims) - rank
    return input.expand([-1 if i >= lead and d == 1 else d for i, d in enumerate(dims)])


@register("Tile", host_inputs=(1,), aliases=SAME)
def tile(input: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
    return input.repeat(repeats.tolist())


@register("Transpose", aliases=SAME, view=True)
def transpose(data: torch.Tensor, perm: list[int] | None = None) -> torch.Tensor:
    if perm is None:
        return data.permute(*range(data.dim() - 1, -1, -1))
    return data.permute(perm)


@register("Cast", aliases=SAME, sets_dtype=True)
def cast(input: torch.Tensor, to: int, saturate: int = 1, round_mode: str = "up") -> torch.Tensor:
    # saturate/round_mode only concern float8/float4 targets, which torch_dtype_from_onnx refuses.
    return input.to(torch_dtype_from_onnx(to, what="Cast"))


@register("CastLike", meta_inputs=(1,), aliases=SAME, sets_dtype=True)
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


@register("ConstantOfShape", needs_device=True, host_inputs=(0,))
def constant_of_shape(
    input: torch.Tensor, value: torch.Tensor | None = None, _device: torch.device | None = None
) -> torch.Tensor:
    dims = input.tolist()
    if value is None:
        return torch.zeros(dims, dtype=torch.float32, device=_device)
    return torch.full(dims, value.item(), dtype=value.dtype, device=_device)


@register("Range", needs_device=True, host_inputs=(0, 1, 2))
def range_(
    start: torch.Tensor, limit: torch.Tensor, delta: torch.Tensor, _device: torch.device | None = None
) -> torch.Tensor:
    s, lim, d = start.item(), limit.item(), delta.item()
    if start.is_floating_point():
        # ONNX fixes the count as ceil((limit - start) / delta) and the values as start + i * delta.
        n = max(math.ceil((lim - s) / d), 0)
        return (torch.arange(n, dtype=torch.float64, device=_device) * d + s).to(start.dtype)
    return torch.arange(s, lim, d, dtype=start.dtype, device=_device)


@register("Trilu", host_inputs=(1,))
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


@register("Pad", host_inputs=(1, 2, 3), aliases=SAME)
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


@register("EyeLike")
def eye_like(input: torch.Tensor, dtype: int | None = None, k: int = 0) -> torch.Tensor:
    out_dtype = torch_dtype_from_onnx(dtype, what="EyeLike") if dtype is not None else input.dtype
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


@register("CenterCropPad", host_inputs=(1,))
def center_crop_pad(
    input_data: torch.Tensor, shape: torch.Tensor, axes: list[int] | None = None
) -> torch.Tensor:
    rank = input_data.dim()
    axes = [a % rank for a in axes] if axes is not None else list(range(rank))
    # Negative F.pad amounts crop; the odd pixel goes to the end in both directions.
    tp = [0] * (2 * rank)
    for ax, want in zip(axes, shape.tolist()):
        diff = want - input_data.shape[ax]
        j = 2 * (rank - 1 - ax)
        half = abs(diff) // 2
        begin, end = (half, diff - half) if diff >= 0 else (-half, diff + half)
        tp[j], tp[j + 1] = begin, end
    return F.pad(input_data, tp)


def _window(op: str, formula):
    """The kernel of window op `op`: `formula(i, n)` over i = 0 .. size-1 in float64 (n the
    period: size when `periodic`, else size - 1), then cast to `output_datatype`."""

    def kernel(size: torch.Tensor, output_datatype: int = 1, periodic: int = 1, _device=None) -> torch.Tensor:
        dtype = torch_dtype_from_onnx(output_datatype, what=op)
        n = int(size)
        i = torch.arange(n, dtype=torch.float64, device=_device)
        return formula(i, n if periodic else n - 1).to(dtype)

    return kernel


_HAMMING_ALPHA = 25.0 / 46.0  # ONNX's coefficients, not torch's rounded 0.54 / 0.46

# (op type, the window's value at i of period n)
for _type, _formula in (
    ("HannWindow", lambda i, n: torch.sin(i * math.pi / n) ** 2),
    ("HammingWindow", lambda i, n: _HAMMING_ALPHA - (1 - _HAMMING_ALPHA) * torch.cos(i * 2 * math.pi / n)),
    (
        "BlackmanWindow",
        lambda i, n: 0.42 - 0.5 * torch.cos(i * 2 * math.pi / n) + 0.08 * torch.cos(i * 4 * math.pi / n),
    ),
):
    register(_type, needs_device=True, host_inputs=(0,))(_window(_type, _formula))

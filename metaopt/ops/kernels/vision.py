"""Spatial sampling and block ops: GridSample, AffineGrid, Col2Im, MaxUnpool."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from metaopt.ops.registry import register

# ONNX GridSample modes (opset 20 names and the opset 16 ones) -> torch's.
_GRID_MODE = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest", "cubic": "bicubic",
              "bicubic": "bicubic"}  # fmt: skip


@register("GridSample")
def grid_sample(
    X: torch.Tensor,
    grid: torch.Tensor,
    align_corners: int = 0,
    mode: str = "linear",
    padding_mode: str = "zeros",
) -> torch.Tensor:
    return F.grid_sample(X, grid, _GRID_MODE[mode], padding_mode, bool(align_corners))


@register("AffineGrid", host_inputs=(1,))
def affine_grid(theta: torch.Tensor, size: torch.Tensor, align_corners: int = 0) -> torch.Tensor:
    return F.affine_grid(theta, size.tolist(), bool(align_corners))


@register("Col2Im", host_inputs=(1, 2))
def col2im(
    input: torch.Tensor,
    image_shape: torch.Tensor,
    block_shape: torch.Tensor,
    dilations: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> torch.Tensor:
    image, block = image_shape.tolist(), block_shape.tolist()
    n = len(image)
    dilations = dilations or [1] * n
    strides = strides or [1] * n
    pads = pads or [0] * (2 * n)
    begin, end = pads[:n], pads[n:]
    if n == 2:
        if begin == end:
            return F.fold(input, image, block, dilations, begin, strides)
        padded = [i + b + e for i, b, e in zip(image, begin, end)]
        out = F.fold(input, padded, block, dilations, 0, strides)
        return out[..., begin[0] : begin[0] + image[0], begin[1] : begin[1] + image[1]]
    return _col2im_nd(input, image, block, dilations, begin, end, strides)


def _col2im_nd(x, image, block, dilations, begin, end, strides) -> torch.Tensor:
    """Col2Im for any number of spatial dims: scatter-add every column entry into the image."""
    batch, rows, blocks = x.shape
    k = math.prod(block)
    channels = rows // k
    padded = [i + b + e for i, b, e in zip(image, begin, end)]
    counts = [(p - d * (kk - 1) - 1) // s + 1 for p, d, kk, s in zip(padded, dilations, block, strides)]
    # Flat padded-image position of (kernel offset, block position), in ONNX's row-major orders.
    pos = torch.zeros(k, blocks, dtype=torch.int64)
    for ki, koff in enumerate(itertools.product(*(range(kk) for kk in block))):
        for bi, boff in enumerate(itertools.product(*(range(c) for c in counts))):
            flat = 0
            for d in range(len(image)):
                flat = flat * padded[d] + boff[d] * strides[d] + koff[d] * dilations[d]
            pos[ki, bi] = flat
    out = torch.zeros(batch, channels, math.prod(padded), dtype=x.dtype, device=x.device)
    src = x.reshape(batch, channels, k * blocks)
    out.index_add_(2, pos.reshape(-1).to(x.device), src)  # a fresh tensor: in place is safe
    out = out.reshape(batch, channels, *padded)
    for d in range(len(image)):
        out = out.narrow(2 + d, begin[d], image[d])
    return out


@register("MaxUnpool", host_inputs=(2,))
def max_unpool(
    X: torch.Tensor,
    I: torch.Tensor,  # noqa: E741 (ONNX's name)
    output_shape: torch.Tensor | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> torch.Tensor:
    n = len(kernel_shape)
    strides = strides or [1] * n
    pads = pads or [0] * (2 * n)
    spatial = [
        (X.shape[2 + d] - 1) * strides[d] - (pads[d] + pads[n + d]) + kernel_shape[d] for d in range(n)
    ]
    # ONNX indices (as MaxPool produces them) address the whole flattened output tensor.
    flat = torch.zeros(X.shape[0] * X.shape[1] * math.prod(spatial), dtype=X.dtype, device=X.device)
    flat = flat.scatter(0, I.reshape(-1).to(X.device), X.reshape(-1))
    y = flat.reshape(X.shape[0], X.shape[1], *spatial)
    if output_shape is None:
        return y
    want = output_shape.tolist()
    extra = []
    for d in reversed(range(n)):
        extra += (0, want[2 + d] - spatial[d])
    return F.pad(y, extra)

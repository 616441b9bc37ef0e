"""Resize (opset 11-19 semantics) and the deprecated Upsample, ported from the ONNX reference.

Resize is separable: each resized axis gathers `n` neighbours per output position and
takes their weighted sum. The neighbour indices and weights depend only on the geometry
(sizes, scale, modes), never on the data, so they are computed once in numpy (float64,
exactly as the reference does) and cached; a call then costs one gather and one weighted
sum per axis on the device. Nearest mode gathers the one selected neighbour, which keeps
integer types exact.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from metaopt.ops.registry import register


def _source_coords(
    mode: str, scale: float, in_len: int, out_len: int, roi
) -> tuple[np.ndarray, np.ndarray | None]:
    """The input coordinate of every output position, and which ones extrapolate."""
    y = np.arange(out_len, dtype=np.float64)
    out_width = scale * in_len
    if mode == "align_corners":
        x = np.zeros(out_len) if out_width == 1 else y * (in_len - 1) / (out_width - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        if out_width == 1:
            x = np.full(out_len, (roi[1] - roi[0]) * (in_len - 1) / 2)
        else:
            x = y * (roi[1] - roi[0]) * (in_len - 1) / (out_width - 1)
        x = x + roi[0] * (in_len - 1)
        return x, (x < 0) | (x > in_len - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out_len, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_width)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ValueError(f"Resize: unknown coordinate_transformation_mode {mode!r}")
    return x, None


def _coeffs(
    mode: str, ratios: np.ndarray, scale: float, nearest_mode: str, a: float, antialias: int
) -> np.ndarray:
    """(out_len, n) interpolation weights for the fractional positions `ratios` in (0, 1]."""
    r = ratios[:, None]
    if mode == "nearest":
        whole = r == 1.0
        if nearest_mode == "round_prefer_floor":
            first = r <= 0.5
        elif nearest_mode == "round_prefer_ceil":
            first = r < 0.5
        elif nearest_mode == "floor":
            first = np.ones_like(r, dtype=bool)
        elif nearest_mode == "ceil":
            first = np.zeros_like(r, dtype=bool)
        else:
            raise ValueError(f"Resize: unknown nearest_mode {nearest_mode!r}")
        first = first & ~whole
        return np.concatenate((first, ~first), 1).astype(np.float64)
    if mode == "linear":
        if not antialias:
            return np.concatenate((1 - r, r), 1)
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        args = (np.arange(start, 2 - start)[None, :] - r) * s
        w = np.clip(1 - np.abs(args), 0, 1)
        return w / w.sum(1, keepdims=True)
    if mode == "cubic":
        if not antialias:
            return np.concatenate(
                (
                    ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                    ((a + 2) * r - (a + 3)) * r * r + 1,
                    ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                    ((a * ((1 - r) + 1) - 5 * a) * ((1 - r) + 1) + 8 * a) * ((1 - r) + 1) - 4 * a,
                ),
                1,
            )
        s = min(scale, 1.0)
        start = int(np.floor(-2 / s) + 1)
        t = np.abs(s * (np.arange(start, 2 - start)[None, :] - r))
        w = np.where(
            t <= 1,
            (a + 2) * t**3 - (a + 3) * t**2 + 1,
            np.where(t < 2, a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a, 0.0),
        )
        return w / w.sum(1, keepdims=True)
    raise ValueError(f"Resize: unknown mode {mode!r}")


@functools.lru_cache(maxsize=256)
def _axis_plan(in_len, out_len, scale, roi, mode, coord_mode, nearest_mode, a, antialias, exclude_outside):
    """(neighbour indices (out, n), weights (out, n), extrapolated mask or None) for one axis."""
    x, extrapolated = _source_coords(coord_mode, scale, in_len, out_len, roi)
    x_int = np.floor(x)
    ratios = np.where(x == x_int, 1.0, x - x_int)  # the reference prefers the left pixel
    w = _coeffs(mode, ratios, scale, nearest_mode, a, antialias)
    n = w.shape[1]
    # The n nearest indices to x, ties to the smaller one (the reference's edge-padded window).
    pad = math.ceil(n / 2)
    xp = x + pad
    p = np.floor(xp).astype(np.int64)
    frac = xp - p
    if n % 2 == 0:
        shift = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        shift = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    idx = (p + shift)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        w = np.where((idx < 0) | (idx >= in_len), 0.0, w)
        total = w.sum(1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    idx = np.clip(idx, 0, in_len - 1)
    if mode == "nearest":  # one-hot weights: keep just the chosen neighbour
        idx = idx[np.arange(out_len), w.argmax(1)][:, None]
        w = None
    mask = extrapolated if extrapolated is not None and extrapolated.any() else None
    return idx, w, mask


def _resize_axis(x: torch.Tensor, axis: int, plan, extrapolation_value: float, compute: torch.dtype):
    idx, w, mask = plan
    out_len, n = idx.shape
    index = torch.from_numpy(idx.reshape(-1)).to(x.device)
    g = x.index_select(axis, index)
    if w is not None:
        g = g.to(compute).unflatten(axis, (out_len, n))
        shape = [1] * g.dim()
        shape[axis], shape[axis + 1] = out_len, n
        g = (g * torch.from_numpy(w).to(device=x.device, dtype=compute).reshape(shape)).sum(axis + 1)
    if mask is not None:
        shape = [1] * g.dim()
        shape[axis] = out_len
        fill = torch.tensor(extrapolation_value, dtype=g.dtype, device=x.device)
        g = torch.where(torch.from_numpy(mask).to(x.device).reshape(shape), fill, g)
    return g


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if dtype.is_floating_point else torch.float64


def _saturate(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if y.dtype == dtype:
        return y
    if not dtype.is_floating_point and dtype != torch.bool:
        info = torch.iinfo(dtype)
        y = torch.round(y).clamp(info.min, info.max)
    return y.to(dtype)


def _floats(v) -> list[float] | None:
    if v is None:
        return None
    vals = v.tolist() if isinstance(v, torch.Tensor) else list(v)
    return vals or None  # an empty tensor means "not given"


def _output_bytes(x, scales, sizes, axes) -> int | None:
    """Resize/Upsample compute coordinate tables in numpy, out of the meta device's sight: their
    output size from the input shape and the scales/sizes values, before the kernel runs."""
    if x is None:
        return None
    axes = axes or list(range(x.dim()))
    out = list(x.shape)
    if sizes is not None and sizes.numel():
        values = [int(v) for v in sizes.reshape(-1).tolist()]
        for a, v in zip(axes, values, strict=False):
            out[a] = max(v, 0)
    elif scales is not None and scales.numel():
        values = [float(v) for v in scales.reshape(-1).tolist()]
        for a, v in zip(axes, values, strict=False):
            if not math.isfinite(v) or v < 0:
                return None
            out[a] = math.floor(out[a] * v)
    return math.prod(out) * x.element_size()


def _resize_bytes(attrs: dict, args: list) -> int | None:
    """Resize(X, roi, scales, sizes)."""
    at = lambda k: args[k] if len(args) > k else None  # noqa: E731
    return _output_bytes(at(0), at(2), at(3), attrs.get("axes"))


def _upsample_bytes(attrs: dict, args: list) -> int | None:
    """Upsample(X, scales)."""
    return _output_bytes(args[0] if args else None, args[1] if len(args) > 1 else None, None, None)


@register("Resize", host_inputs=(1, 2, 3), output_bytes=_resize_bytes)
def resize(
    X: torch.Tensor,
    roi: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    sizes: torch.Tensor | None = None,
    antialias: int = 0,
    axes: list[int] | None = None,
    coordinate_transformation_mode: str = "half_pixel",
    cubic_coeff_a: float = -0.75,
    exclude_outside: int = 0,
    extrapolation_value: float = 0.0,
    keep_aspect_ratio_policy: str = "stretch",
    mode: str = "nearest",
    nearest_mode: str = "round_prefer_floor",
) -> torch.Tensor:
    rank = X.dim()
    axes = [a % rank for a in axes] if axes is not None else list(range(rank))
    shape = list(X.shape)
    scale_v, size_v, roi_v = _floats(scales), _floats(sizes), _floats(roi)
    # Everything per resized axis, in `axes` order.
    if size_v is not None:
        out = [int(s) for s in size_v]
        fac = [o / shape[a] for o, a in zip(out, axes)]
        if keep_aspect_ratio_policy != "stretch":
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            s = pick(fac)
            fac = [s] * len(axes)
            out = [int(s * shape[a] + 0.5) for a in axes]
    else:
        fac = scale_v
        out = [int(f * shape[a]) for f, a in zip(fac, axes)]
    k = len(axes)
    y = X
    compute = _compute_dtype(X.dtype)
    for i, ax in enumerate(axes):
        axis_roi = (roi_v[i], roi_v[k + i]) if roi_v is not None else None
        trivial_roi = axis_roi is None or (math.isclose(axis_roi[0], 0.0) and math.isclose(axis_roi[1], 1.0))
        if math.isclose(fac[i], 1.0) and out[i] == shape[ax] and trivial_roi:
            continue  # identity along this axis
        plan = _axis_plan(
            y.shape[ax], out[i], float(fac[i]), axis_roi, mode, coordinate_transformation_mode,
            nearest_mode, float(cubic_coeff_a), int(antialias), int(exclude_outside),
        )  # fmt: skip
        y = _resize_axis(y, ax, plan, extrapolation_value, compute)
    return _saturate(y, X.dtype)


@register("Upsample", host_inputs=(1,), output_bytes=_upsample_bytes)
def upsample(X: torch.Tensor, scales: torch.Tensor | None = None, mode: str = "nearest") -> torch.Tensor:
    # Opset 9's Upsample: asymmetric coordinates; nearest takes floor(i / scale).
    return resize(
        X, None, scales, coordinate_transformation_mode="asymmetric", mode=mode, nearest_mode="floor"
    )

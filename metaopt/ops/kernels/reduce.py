"""Reductions, arg-reductions, scans and TopK.

Reduce ops take `axes` as an attribute (old opsets) or as an optional int64 input
(ReduceSum since 13, the others since 18); both arrive as the `axes` argument, a list or a
tensor, and are treated alike.
"""

from __future__ import annotations

import torch

from metaopt.ops.kernels.norm import fuse_rms_norm
from metaopt.ops.registry import register


def _axes(x: torch.Tensor, axes, noop_with_empty_axes: int) -> tuple[int, ...] | None:
    """The dims to reduce, or None for "return the input unchanged"."""
    if axes is not None:
        if isinstance(axes, torch.Tensor):
            axes = axes.tolist()
        if len(axes):
            return tuple(axes)
    if noop_with_empty_axes:
        return None
    return tuple(range(x.dim()))


def _reducer(fn):
    """A Reduce* kernel from `fn(x, dims, keepdim)`; the ONNX plumbing is shared."""

    def kernel(
        data: torch.Tensor, axes=None, keepdims: int = 1, noop_with_empty_axes: int = 0
    ) -> torch.Tensor:
        dims = _axes(data, axes, noop_with_empty_axes)
        if dims is None:
            return data
        if not dims:  # a 0-d input: every reduction of one element is that element's transform
            return fn(data.reshape(1), (0,), False)
        return fn(data, dims, bool(keepdims))

    kernel.__name__ = fn.__name__
    return kernel


def _empty_fill(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool, value: float) -> torch.Tensor:
    # Reducing an empty set gives the reduction's identity (ONNX), where torch raises.
    dims_n = {d % x.dim() for d in dims}
    shape = [1 if i in dims_n else s for i, s in enumerate(x.shape) if keepdim or i not in dims_n]
    return torch.full(shape, value, dtype=x.dtype, device=x.device)


def _max(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    if x.dtype == torch.bool:
        return torch.any(x, dim=dims, keepdim=keepdim)
    if x.numel() == 0:
        low = -float("inf") if x.is_floating_point() else torch.iinfo(x.dtype).min
        return _empty_fill(x, dims, keepdim, low)
    return torch.amax(x, dim=dims, keepdim=keepdim)


def _min(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    if x.dtype == torch.bool:
        return torch.all(x, dim=dims, keepdim=keepdim)
    if x.numel() == 0:
        high = float("inf") if x.is_floating_point() else torch.iinfo(x.dtype).max
        return _empty_fill(x, dims, keepdim, high)
    return torch.amin(x, dim=dims, keepdim=keepdim)


def _sum(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=x.dtype)


def _mean(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    if not x.is_floating_point():  # ONNX keeps integer types: mean of ints truncates
        return torch.div(torch.sum(x, dims, keepdim), _count(x, dims), rounding_mode="trunc").to(x.dtype)
    return torch.mean(x, dim=dims, keepdim=keepdim)


def _count(x: torch.Tensor, dims) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d]
    return n


def _prod(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    # torch.prod reduces one dim at a time; go from the last dim so indices stay valid.
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        x = torch.prod(x, d, keepdim=keepdim, dtype=x.dtype)
    return x


def _l1(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    return torch.sum(torch.abs(x), dim=dims, keepdim=keepdim, dtype=x.dtype)


def _l2(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    if not x.is_floating_point():
        return torch.sqrt(torch.sum(x * x, dim=dims, keepdim=keepdim).double()).to(x.dtype)
    return torch.linalg.vector_norm(x, 2, dim=dims, keepdim=keepdim)


def _sum_square(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    return torch.sum(x * x, dim=dims, keepdim=keepdim, dtype=x.dtype)


def _log_sum(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    return torch.log(torch.sum(x, dim=dims, keepdim=keepdim))


def _log_sum_exp(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    if x.numel() == 0:
        return _empty_fill(x, dims, keepdim, -float("inf"))
    if not x.is_floating_point():
        return torch.logsumexp(x.double(), dim=dims, keepdim=keepdim).to(x.dtype)
    return torch.logsumexp(x, dim=dims, keepdim=keepdim)


def _noop_alias(op) -> tuple[tuple[int, int], ...]:
    # Only noop_with_empty_axes may hand back the input itself (when the axes are empty).
    return ((0, 0),) if op.attrs.get("noop_with_empty_axes", 0) else ()


# (op type, reduction, AMP class): reductions that sum run in float32 under AMP; max and min are
# exact in any dtype.
for _type, _fn, _amp in (
    ("ReduceMax", _max, "gray"),
    ("ReduceMin", _min, "gray"),
    ("ReduceSum", _sum, "black"),
    ("ReduceMean", _mean, "black"),
    ("ReduceProd", _prod, "black"),
    ("ReduceL1", _l1, "black"),
    ("ReduceL2", _l2, "black"),
    ("ReduceSumSquare", _sum_square, "black"),
    ("ReduceLogSum", _log_sum, "black"),
    ("ReduceLogSumExp", _log_sum_exp, "black"),
):
    # ReduceMean anchors the RMSNorm chain torch exports (HF's LlamaRMSNorm, T5LayerNorm)
    _fuse = fuse_rms_norm if _type == "ReduceMean" else None
    register(_type, host_inputs=(1,), aliases=_noop_alias, amp=_amp, fuse=_fuse)(_reducer(_fn))


def _arg_reducer(fn):
    """An Arg* kernel from torch's `fn(x, dim, keepdim)` (argmax / argmin, which pick the first of
    equal values); ONNX's select_last_index is the first index in the input flipped along `axis`."""

    def kernel(
        data: torch.Tensor, axis: int = 0, keepdims: int = 1, select_last_index: int = 0
    ) -> torch.Tensor:
        if select_last_index:
            n = data.shape[axis]
            return (n - 1) - fn(data.flip(axis), axis, bool(keepdims))
        return fn(data, axis, bool(keepdims))

    return kernel


arg_max = register("ArgMax")(_arg_reducer(torch.argmax))
arg_min = register("ArgMin")(_arg_reducer(torch.argmin))


def _scan(
    fn, x: torch.Tensor, axis: torch.Tensor, exclusive: int, reverse: int, identity: int
) -> torch.Tensor:
    dim = int(axis)
    if reverse:
        x = x.flip(dim)
    out = fn(x, dim, dtype=x.dtype)
    if exclusive:
        # Shift by one along `dim`: the identity first, the last partial result dropped.
        first = torch.full_like(x.narrow(dim, 0, 1), identity)
        out = torch.cat((first, out.narrow(dim, 0, x.shape[dim] - 1)), dim)
    return out.flip(dim) if reverse else out


@register("CumSum", host_inputs=(1,), amp="black")
def cum_sum(x: torch.Tensor, axis: torch.Tensor, exclusive: int = 0, reverse: int = 0) -> torch.Tensor:
    if not exclusive and not reverse:
        return torch.cumsum(x, int(axis), dtype=x.dtype)
    return _scan(torch.cumsum, x, axis, exclusive, reverse, 0)


@register("CumProd", host_inputs=(1,), amp="black")
def cum_prod(x: torch.Tensor, axis: torch.Tensor, exclusive: int = 0, reverse: int = 0) -> torch.Tensor:
    return _scan(torch.cumprod, x, axis, exclusive, reverse, 1)


@register("TopK", host_inputs=(1,))
def top_k(
    x: torch.Tensor, K: torch.Tensor | None = None, axis: int = -1, largest: int = 1, sorted: int = 1, k=None
) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(K) if K is not None else k  # K is an input since opset 10, an attribute before
    # A stable sort gives ONNX's tie rule (the lower index first); topk does not promise it.
    values, indices = torch.sort(x, dim=axis, descending=bool(largest), stable=True)
    if n == x.shape[axis]:
        return values, indices
    # copies of the first k: views would keep the whole sort alive (k of n experts: n / k times
    # the bytes its outputs' shapes say, what estimate_memory counts)
    return values.narrow(axis, 0, n).clone(), indices.narrow(axis, 0, n).clone()

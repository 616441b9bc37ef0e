"""Convolution, pooling and the linear-algebra ops (MatMul, Gemm, Einsum).

ONNX pads are ``[x1_begin, x2_begin, ..., x1_end, x2_end, ...]``; torch only pads
symmetrically inside conv/pool, so asymmetric pads go through an explicit ``F.pad`` first.
The common case (symmetric pads, NOTSET) calls the torch op directly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from metaopt.ops import onnx_bodies
from metaopt.ops.registry import LONE_INPUT, register

_CONV = (None, F.conv1d, F.conv2d, F.conv3d)
_CONV_T = (None, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
_MAX_POOL = (None, F.max_pool1d, F.max_pool2d, F.max_pool3d)
_AVG_POOL = (None, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)


# --------------------------------------------------------------------------- linear algebra


def _fuse_linear(q: Any, i: int, producer: dict[str, int], consumers: dict[str, list[int]]):
    """MatMul's `fuse` rule: torch exports an nn.Linear on a >2-D input as
    ``Add(MatMul(x, Transpose(W, perm=[1, 0])), b)``, or without a bias (LLaMA's projections,
    tied LM heads) as ``MatMul(x, Transpose(W, perm=[1, 0]))``; that is ``Linear(x, W[, b])``,
    one `F.linear` call. Without a bias the forward is the same BLAS call either way; the fused
    op's grad is what autograd gives nn.Linear (dW = dYᵀX in W's layout, where MatMul's grad
    hands back the transpose of dWᵀ, a strided view the update then reads), and tensor parallel
    finds its layers by `Linear` (ops/sharding.py). Only params qualify (a transposed activation
    is a real computation), and only when the intermediate values have no other reader."""
    from metaopt.ir import Op

    op = q.ops[i]
    if len(op.inputs) != 2:
        return None
    t_idx = producer.get(op.inputs[1])
    if t_idx is None:
        return None
    t = q.ops[t_idx]
    w = t.inputs[0] if t.type == "Transpose" else None
    if (
        w is None
        or q.vars[w].kind != "param"
        or len(q.vars[w].shape or ()) != 2
        or t.attrs.get("perm") != [1, 0]
        or consumers.get(t.outputs[0]) != [i]
    ):
        return None
    readers = consumers.get(op.outputs[0], [])
    add = q.ops[readers[0]] if len(readers) == 1 else None
    bias = next((x for x in add.inputs if x != op.outputs[0]), None) if add is not None else None
    if (
        add is None
        or add.type != "Add"
        or bias is None
        or q.vars[bias].kind != "param"
        or q.vars[bias].shape != (q.vars[w].shape[0],)
    ):
        fused = Op("Linear", [op.inputs[0], w], list(op.outputs), {}, role=op.role, scope=op.scope)
        return [t_idx], fused
    fused = Op("Linear", [op.inputs[0], w, bias], list(add.outputs), {}, role=op.role, scope=add.scope)
    return [t_idx, readers[0]], fused


register("MatMul", expensive=True, amp="white", fuse=_fuse_linear)(torch.matmul)


@register("Gemm", expensive=True, amp="white")
def gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
) -> torch.Tensor:
    if transB and not transA and alpha == 1.0 and beta == 1.0 and (C is None or C.dim() == 1):
        return F.linear(A, B, C)  # exactly what torch's Linear computes
    a = A.t() if transA else A
    b = B.t() if transB else B
    if C is None:
        out = torch.mm(a, b)
        return out if alpha == 1.0 else out * alpha
    if not A.is_floating_point():
        return torch.addmm(C, a, b, beta=int(beta), alpha=int(alpha))
    return torch.addmm(C, a, b, beta=beta, alpha=alpha)


register("Det")(torch.linalg.det)


@register("Einsum", expensive=True, aliases=LONE_INPUT, amp="white")
def einsum(*inputs: torch.Tensor, equation: str) -> torch.Tensor:
    return torch.einsum(equation.replace(" ", ""), *inputs)


# --------------------------------------------------------------------------- padding helpers


def _auto_pads(auto_pad: str, sizes, kernel, strides, dilations) -> list[int]:
    """Explicit ONNX pads for SAME_UPPER / SAME_LOWER / VALID."""
    n = len(sizes)
    if auto_pad == "VALID":
        return [0] * (2 * n)
    begin, end = [], []
    for size, k, s, d in zip(sizes, kernel, strides, dilations):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, big = total // 2, total - total // 2
        # SAME_UPPER puts the odd extra pad at the end, SAME_LOWER at the beginning.
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return begin + end


def _torch_pad(begin, end) -> list[int]:
    """ONNX begin/end lists over the spatial dims -> F.pad's (last dim first) list."""
    out: list[int] = []
    for b, e in zip(reversed(begin), reversed(end)):
        out += (b, e)
    return out


def _ones(n: int) -> list[int]:
    return [1] * n


# --------------------------------------------------------------------------- convolution


@register("Conv", zero_bias_input=2, expensive=True, amp="white", channels_last=1)
def conv(
    X: torch.Tensor,
    W: torch.Tensor,
    B: torch.Tensor | None = None,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    group: int = 1,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
    memory_format: str = "",
) -> torch.Tensor:
    """ONNX Conv. `memory_format` (metaopt's, set by passes/channels_last.py): "channels_last"
    runs a 2-D convolution on a channels-last copy of `X` (none when `X` already is one), so the
    output is channels-last too and every op downstream that keeps the layout stays in it."""
    n = W.dim() - 2
    strides = strides or _ones(n)
    dilations = dilations or _ones(n)
    if auto_pad != "NOTSET":
        pads = _auto_pads(auto_pad, X.shape[2:], W.shape[2:], strides, dilations)
    padding = 0
    if pads is not None:
        begin, end = pads[:n], pads[n:]
        if begin == end:
            padding = begin
        else:
            X = F.pad(X, _torch_pad(begin, end))
    return _CONV[n](in_memory_format(X, memory_format), W, B, strides, padding, dilations, group)


MEMORY_FORMATS = {"": None, "channels_last": torch.channels_last}


def is_channels_last(t: torch.Tensor) -> bool:
    """A 4-D tensor laid out channels-last (and not also plain contiguous: size-1 dims)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def in_memory_format(x: torch.Tensor, memory_format: str) -> torch.Tensor:
    """`x` laid out as `memory_format` ("" leaves it as it is; a 4-D tensor already in the
    format is returned itself, no copy)."""
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format={memory_format!r}: expected one of {sorted(MEMORY_FORMATS)}")
    fmt = MEMORY_FORMATS[memory_format]
    if fmt is None or x.dim() != 4:
        return x
    return x.contiguous(memory_format=fmt)


@register("ConvTranspose", zero_bias_input=2, expensive=True, amp="white")
def conv_transpose(
    X: torch.Tensor,
    W: torch.Tensor,
    B: torch.Tensor | None = None,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    group: int = 1,
    kernel_shape: list[int] | None = None,
    output_padding: list[int] | None = None,
    output_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> torch.Tensor:
    n = W.dim() - 2
    strides = strides or _ones(n)
    dilations = dilations or _ones(n)
    output_padding = output_padding or [0] * n
    sizes = X.shape[2:]
    full = [(i - 1) * s + (k - 1) * d + 1 for i, s, k, d in zip(sizes, strides, W.shape[2:], dilations)]
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = output_shape[-n:] if output_shape is not None else [i * s for i, s in zip(sizes, strides)]
        total = [f + op - t for f, op, t in zip(full, output_padding, target)]
        if auto_pad == "SAME_UPPER":
            begin, end = [t // 2 for t in total], [t - t // 2 for t in total]
        else:
            begin, end = [t - t // 2 for t in total], [t // 2 for t in total]
    elif pads is not None and auto_pad == "NOTSET":
        begin, end = pads[:n], pads[n:]
    else:
        begin, end = [0] * n, [0] * n
    # The full transposed conv, then ONNX's pads crop it and output_padding extends its end.
    y = _CONV_T[n](X, W, None, strides, 0, 0, group, dilations)
    crop = _torch_pad([-b for b in begin], [op - e for op, e in zip(output_padding, end)])
    if any(crop):
        y = F.pad(y, crop)
    if B is not None:
        y = y + B.reshape((-1,) + (1,) * n)
    return y


# --------------------------------------------------------------------------- pooling


def _pool_geometry(x, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode):
    """(strides, dilations, begin pads, end pads, ONNX output sizes) of a pooling op."""
    n = len(kernel_shape)
    sizes = x.shape[2:]
    strides = strides or _ones(n)
    dilations = dilations or _ones(n)
    if auto_pad != "NOTSET":
        pads = _auto_pads(auto_pad, sizes, kernel_shape, strides, dilations)
    pads = pads or [0] * (2 * n)
    begin, end = pads[:n], pads[n:]
    out = []
    for i in range(n):
        span = sizes[i] + begin[i] + end[i] - (kernel_shape[i] - 1) * dilations[i] - 1
        if ceil_mode:
            o = -(-span // strides[i]) + 1
            if (o - 1) * strides[i] >= sizes[i] + begin[i]:  # the last window must start inside
                o -= 1
        else:
            o = span // strides[i] + 1
        out.append(o)
    return strides, dilations, begin, end, out


def _fits_torch(kernel_shape, dilations, begin, end) -> bool:
    # torch pools pad symmetrically and at most half the (dilated) window.
    return begin == end and all(2 * p <= (k - 1) * d + 1 for p, k, d in zip(begin, kernel_shape, dilations))


def _narrow_to(y: torch.Tensor, out: list[int]) -> torch.Tensor:
    for i, o in enumerate(out):
        if y.shape[2 + i] != o:
            y = y.narrow(2 + i, 0, o)
    return y


@register("MaxPool", needs_outputs=True)
def max_pool(
    X: torch.Tensor,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    storage_order: int = 0,
    strides: list[int] | None = None,
    _nout: int = 1,
):
    n = len(kernel_shape)
    strides, dilations, begin, end, out = _pool_geometry(
        X, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode
    )
    x = X if X.is_floating_point() else X.to(torch.float64)  # torch pools floats only
    if _fits_torch(kernel_shape, dilations, begin, end):
        padding, pre = begin, False
    else:
        x = F.pad(x, _torch_pad(begin, end), value=-math.inf)
        padding, pre = 0, True
    y = _MAX_POOL[n](x, kernel_shape, strides, padding, dilations, bool(ceil_mode), _nout > 1)
    idx = None
    if _nout > 1:
        y, idx = y
        idx = _onnx_indices(_narrow_to(idx, out), X.shape, x.shape, begin if pre else None, storage_order)
    y = _narrow_to(y, out)
    if y.dtype != X.dtype:
        y = y.to(X.dtype)
    return (y, idx) if _nout > 1 else y


@register("MaxPoolGrad", domain="metaopt", fresh_outputs=True)
def max_pool_grad(
    dy: torch.Tensor,
    X: torch.Tensor,
    indices: torch.Tensor,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    storage_order: int = 0,
    strides: list[int] | None = None,
) -> torch.Tensor:
    """dX of a 2-D MaxPool from its forward's ONNX indices: torch's own max-pool backward (the
    grad scattered to each window's argmax) when the pooling is torch's (symmetric pads, row-major
    indices, torch's output size); otherwise autograd through the forward kernel."""
    strides_, dilations_, begin, end, out = _pool_geometry(
        X, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode
    )
    torch_out = None
    if _fits_torch(kernel_shape, dilations_, begin, end) and not storage_order:
        meta = torch.empty(X.shape, device="meta", dtype=X.dtype)
        torch_out = F.max_pool2d(meta, kernel_shape, strides_, begin, dilations_, bool(ceil_mode)).shape
    if torch_out is not None and list(torch_out[2:]) == list(out) and X.is_floating_point():
        plane = X.shape[2] * X.shape[3]
        base = torch.arange(X.shape[0] * X.shape[1], device=indices.device).reshape(
            X.shape[0], X.shape[1], 1, 1
        )
        local = indices - base * plane  # ONNX's indices address the flattened input; torch's a plane
        return torch.ops.aten.max_pool2d_with_indices_backward(
            dy, X, kernel_shape, strides_, begin, dilations_, bool(ceil_mode), local
        )
    attrs = {
        "auto_pad": auto_pad,
        "ceil_mode": ceil_mode,
        "dilations": dilations,
        "kernel_shape": kernel_shape,
    }
    with torch.enable_grad():
        x = X.detach().requires_grad_(True)
        y = max_pool(x, pads=pads, storage_order=storage_order, strides=strides, **attrs)
        (dx,) = torch.autograd.grad(y, x, dy)
    return dx


def _onnx_indices(idx, shape, padded_shape, begin, storage_order: int) -> torch.Tensor:
    """torch's per-plane argmax indices -> ONNX's indices into the whole flattened input."""
    spatial = list(shape[2:])
    if begin is not None or storage_order:
        coords = []
        rest = idx
        for size in reversed(padded_shape[2:]):
            coords.append(rest % size)
            rest = rest // size
        coords.reverse()
        if begin is not None:
            coords = [c - b for c, b in zip(coords, begin)]
        order = reversed(range(len(spatial))) if storage_order else range(len(spatial))
        idx = torch.zeros_like(idx)
        for i in order:
            idx = idx * spatial[i] + coords[i]
    plane = math.prod(spatial)
    base = torch.arange(shape[0] * shape[1], device=idx.device).reshape(
        shape[0], shape[1], *([1] * len(spatial))
    )
    return idx + base * plane


def _window_sum(x, kernel_shape, strides, dilations, begin, end, out):
    """Sum over each pooling window (zero padding), by a depthwise conv with a ones kernel."""
    n = len(kernel_shape)
    c = x.shape[1]
    # Extra end padding so the ceil-mode windows fit.
    extra = [
        max((o - 1) * s + (k - 1) * d + 1 - (i + b + e), 0)
        for o, s, k, d, i, b, e in zip(out, strides, kernel_shape, dilations, x.shape[2:], begin, end)
    ]
    xp = F.pad(x, _torch_pad(begin, [e + x_ for e, x_ in zip(end, extra)]))
    ones = torch.ones((c, 1, *kernel_shape), dtype=x.dtype, device=x.device)
    return _narrow_to(_CONV[n](xp, ones, None, strides, 0, dilations, c), out), extra


def _window_count(x, kernel_shape, strides, dilations, begin, end, extra, out, include_pad: bool):
    n = len(kernel_shape)
    sizes = list(x.shape[2:])
    if include_pad:  # padded cells count, ceil-mode overhang does not
        mask = torch.ones(
            [1, 1] + [i + b + e for i, b, e in zip(sizes, begin, end)], dtype=x.dtype, device=x.device
        )
        mask = F.pad(mask, _torch_pad([0] * n, extra))
    else:
        mask = torch.ones([1, 1] + sizes, dtype=x.dtype, device=x.device)
        mask = F.pad(mask, _torch_pad(begin, [e + x_ for e, x_ in zip(end, extra)]))
    ones = torch.ones((1, 1, *kernel_shape), dtype=x.dtype, device=x.device)
    return _narrow_to(_CONV[n](mask, ones, None, strides, 0, dilations), out)


@register("AveragePool")
def average_pool(
    X: torch.Tensor,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    count_include_pad: int = 0,
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> torch.Tensor:
    n = len(kernel_shape)
    strides, dilations, begin, end, out = _pool_geometry(
        X, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode
    )
    if dilations == _ones(n) and _fits_torch(kernel_shape, dilations, begin, end):
        y = _AVG_POOL[n](X, kernel_shape, strides, begin, bool(ceil_mode), bool(count_include_pad))
        return _narrow_to(y, out)
    total, extra = _window_sum(X, kernel_shape, strides, dilations, begin, end, out)
    count = _window_count(
        X, kernel_shape, strides, dilations, begin, end, extra, out, bool(count_include_pad)
    )
    return total / count


@register("AveragePoolGrad", domain="metaopt", fresh_outputs=True)
def average_pool_grad(dy: torch.Tensor, x: torch.Tensor, **attrs: Any) -> torch.Tensor:
    """The AveragePool row's grad: torch's avg_pool{2,3}d_backward where the forward ran torch's
    pooling (zeros for the positions it narrowed away, `_narrow_to`), else autograd on the
    forward kernel (dilations, asymmetric pads, 1-D). `x` is read for its shape only."""
    kernel_shape = attrs["kernel_shape"]
    n = len(kernel_shape)
    strides, dilations, begin, end, _ = _pool_geometry(
        x,
        kernel_shape,
        attrs.get("auto_pad", "NOTSET"),
        attrs.get("pads"),
        attrs.get("strides"),
        attrs.get("dilations"),
        attrs.get("ceil_mode", 0),
    )
    backward = _AVG_POOL_BACKWARD.get(n)
    if backward is None or dilations != [1] * n or not _fits_torch(kernel_shape, dilations, begin, end):
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            (dx,) = torch.autograd.grad(average_pool(xg, **attrs), xg, dy)
        return dx
    ceil, count_pad = bool(attrs.get("ceil_mode", 0)), bool(attrs.get("count_include_pad", 0))
    full = _AVG_POOL[n](x.to("meta"), kernel_shape, strides, begin, ceil, count_pad).shape[2:]
    missing = [f - d for f, d in zip(full, dy.shape[2:], strict=True)]
    if any(missing):
        dy = F.pad(dy, [p for m in reversed(missing) for p in (0, m)])
    return backward(dy, x, kernel_shape, strides, begin, ceil, count_pad, None)


_AVG_POOL_BACKWARD = {2: torch.ops.aten.avg_pool2d_backward, 3: torch.ops.aten.avg_pool3d_backward}


@register("LpPool")
def lp_pool(
    X: torch.Tensor,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    p: int = 2,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> torch.Tensor:
    strides, dilations, begin, end, out = _pool_geometry(
        X, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode
    )
    total, _ = _window_sum(X.abs().pow(p), kernel_shape, strides, dilations, begin, end, out)
    return total.pow(1.0 / p)


def _spatial(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.dim()))


@register("GlobalAveragePool")
def global_average_pool(X: torch.Tensor) -> torch.Tensor:
    return X.mean(_spatial(X), keepdim=True)


@register("GlobalMaxPool")
def global_max_pool(X: torch.Tensor) -> torch.Tensor:
    return X.amax(_spatial(X), keepdim=True)


@register("GlobalLpPool")
def global_lp_pool(X: torch.Tensor, p: int = 2) -> torch.Tensor:
    return torch.linalg.vector_norm(X, p, dim=_spatial(X), keepdim=True)


@register(
    "Linear",
    domain="metaopt",
    expensive=True,
    amp="white",
    onnx_function=onnx_bodies.linear,
    onnx_overload=onnx_bodies.linear_overload,
)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.Linear: x @ weight.T (+ bias) over the last dim (one BLAS call, the bias fused).

    The importer folds the exporter's Transpose(W) -> MatMul (-> Add) chain into this op (the
    MatMul row's `fuse` rule, passes/fuse.py).
    """
    return F.linear(x, weight, bias)

"""Gradient kernels: our own op types (domain metaopt), backed by the backward functions
torch's autograd itself calls, so grads match `torch.autograd` on the same module.

`Vjp` is the generic one: it re-runs a forward kernel under autograd and returns
the vector-Jacobian product, for ops without a hand-written rule (exact, at the
cost of recomputing that op's forward in the backward).
"""

from __future__ import annotations

import torch

from metaopt.ops import registry
from metaopt.ops.kernels.activation import is_torch_hardsigmoid
from metaopt.ops.kernels.loss import _NO_IGNORE as NO_IGNORE  # the forward kernel's choice
from metaopt.ops.kernels.nn import in_memory_format, is_channels_last
from metaopt.ops.registry import SAME, register

aten = torch.ops.aten


@register("ZerosLike", domain="metaopt", fresh_outputs=True)
def zeros_like(x: torch.Tensor) -> torch.Tensor:
    """The grad of an output nobody differentiates, where a rule needs a tensor."""
    return torch.zeros_like(x)


@register("GradSum", domain="metaopt", fresh_outputs=True)
def grad_sum(*parts: torch.Tensor) -> torch.Tensor:
    """The sum of a var's grad contributions, in a fresh contiguous buffer whatever the
    parts' layouts (a tied weight's LM-head contribution arrives transposed; a
    column-major param grad would slow every optimizer op on it), or a channels-last one
    where the first part is channels-last (a conv net's activation grads, passes/channels_last.py:
    the ops that read the sum run in that layout)."""
    fmt = torch.channels_last if is_channels_last(parts[0]) else torch.contiguous_format
    out = torch.empty(parts[0].shape, dtype=parts[0].dtype, device=parts[0].device, memory_format=fmt)
    torch.add(parts[0], parts[1], out=out)
    for t in parts[2:]:
        out.add_(t)
    return out


@register("GradAccumulate", domain="metaopt", inplace=((0, 0),), aliases=SAME)
def grad_accumulate(acc: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
    """The sum of a var's grad contributions, added into the first one in place, as
    torch's AccumulateGrad adds into .grad: the backward emits it only when that first
    contribution is new storage nothing else reads (else GradSum)."""
    if not (acc.is_contiguous() or is_channels_last(acc)):
        return grad_sum(acc, *parts)
    for t in parts:
        acc.add_(t)
    return acc


@register(
    "ScaleGrads",
    domain="metaopt",
    needs_outputs=True,
    inplace=tuple((k, k + 1) for k in range(8)),  # output k is input k + 1, scaled in place
    # The storage is the forward's own new output, read by nothing else (the plan checks that
    # before writing it in place): a grad other contributions may be added into, as a fresh one.
    fresh_outputs=True,
)
def scale_grads(dloss: torch.Tensor, *units: torch.Tensor, _nout: int = 1):
    """Grads a forward op made for a loss grad of 1 (LinearCrossEntropy's, which the backward
    reads nowhere else), each times the loss's actual grad `dloss` (a scalar: 1, AMP's loss scale,
    a pipeline's 1/M), in place: scaled copies would hold every such grad twice at once (the LM
    head's weight grad is vocab x width). In a pipeline stage the units reach the backward as
    values carried from its forward, which the runner donates (`Program.donated`)."""
    k = dloss.reshape(())
    out = tuple(u.mul_(k) for u in units)
    return out if _nout > 1 else out[0]


def _relu_grad_into(j: int):
    """ReluGrad written over its incoming grad `dy` when `dy` dies there (ops/reuse.py)."""

    def kernel(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not (dy.is_contiguous() or is_channels_last(dy)):
            return aten.threshold_backward(dy, y, 0)
        return aten.threshold_backward.grad_input(dy, y, 0, grad_input=dy)

    return kernel


@register("ReluGrad", domain="metaopt", fresh_outputs=True, reuse=((0,), _relu_grad_into))
def relu_grad(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return aten.threshold_backward(dy, y, 0)


@register("GeluGrad", domain="metaopt", fresh_outputs=True)
def gelu_grad(dy: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return aten.gelu_backward(dy, x, approximate=approximate)


@register("PowGrad", domain="metaopt", fresh_outputs=True)
def pow_grad(dy: torch.Tensor, x: torch.Tensor, exponent: float = 1.0) -> torch.Tensor:
    """d(x**n)/dx for a constant scalar n, as autograd's pow_backward forms it:
    ``dy * (n * x**(n - 1))`` (no log term, no grad for the exponent; n == 0 gives zeros)."""
    if exponent == 0.0:
        return torch.zeros_like(x)
    return dy * (exponent * x.pow(exponent - 1.0))


@register("TanhGrad", domain="metaopt", fresh_outputs=True)
def tanh_grad(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return aten.tanh_backward(dy, y)


@register("SigmoidGrad", domain="metaopt", fresh_outputs=True)
def sigmoid_grad(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return aten.sigmoid_backward(dy, y)


@register("SoftmaxGrad", domain="metaopt", fresh_outputs=True)
def softmax_grad(dy: torch.Tensor, y: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return aten._softmax_backward_data(dy, y, axis, y.dtype)


@register("LogSoftmaxGrad", domain="metaopt", fresh_outputs=True)
def log_softmax_grad(dy: torch.Tensor, y: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return aten._log_softmax_backward_data(dy, y, axis, y.dtype)


@register("DropoutGrad", domain="metaopt", host_inputs=(2, 3), fresh_outputs=True)
def dropout_grad(
    dy: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, training_mode: torch.Tensor | None = None
) -> torch.Tensor:
    """Dropout's input grad from its forward mask; with a run-time `training_mode` that
    is false the forward was the identity, and so is this."""
    if training_mode is not None and not bool(training_mode):
        return dy.clone()
    p = float(ratio)
    return aten.native_dropout_backward(dy, mask, 1.0 / (1.0 - p)) if p > 0.0 else dy * mask


@register("LayerNormGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True, masks_outputs=True)
def layer_norm_grad(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    axis: int = -1,
    mask: list[int] | None = None,
    _nout: int = 3,
):
    """(dx, dscale, dbias) via native_layer_norm_backward, as autograd computes them;
    `mask` says which of them are wanted (the others are not computed)."""
    want = [bool(m) for m in (mask or [1] * _nout)] + [False] * 3
    want[2] = want[2] and bias is not None
    # AMP's low x with a float32 scale: upcast on every device. CUDA's kernel refuses the mix
    # (norm.mixed_layer_norm); the CPU's takes it but rounds dscale and dbias through x's dtype
    # (1e-3 relative in float16: the master weights' grads at half precision).
    low = x.dtype if x.dtype != scale.dtype else None
    if low is not None:
        dy, x = dy.to(scale.dtype), x.to(scale.dtype)
    dx, dw, db = aten.native_layer_norm_backward(dy, x, x.shape[axis:], mean, rstd, scale, bias, want[:3])
    if low is not None and dx is not None:
        dx = dx.to(low)
    return (dx, dw, db)[:_nout]


@register("RMSNormGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True, masks_outputs=True)
def rms_norm_grad(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float = 1e-6,
    mask: list[int] | None = None,
    _nout: int = 2,
):
    """(dx, dscale) of RMSNorm over the last dim, from x (its 1/rms again: one fused pass):

        xhat = x / rms,  dscale = sum over rows of dy * xhat,
        dx = (g - xhat * mean(g * xhat, -1)) / rms   with g = dy * scale.

    Half inputs are computed in float32 (the statistics' precision, as torch's norms do)."""
    want = [bool(m) for m in (mask or [1] * _nout)] + [False] * 2
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        dy, x, scale = dy.float(), x.float(), scale.float()
    h = x.shape[-1]
    xhat, rstd = aten._fused_rms_norm(x, [h], None, epsilon)
    dscale = (dy * xhat).reshape(-1, h).sum(0).to(dtype) if want[1] else None
    dx = None
    if want[0]:
        g = dy * scale
        c = (g * xhat).mean(-1, keepdim=True)
        dx = g.addcmul_(xhat, c, value=-1.0).mul_(rstd).to(dtype)
    return (dx, dscale)[:_nout]


@register("SliceGrad", domain="metaopt", fresh_outputs=True)
def slice_grad(
    dy: torch.Tensor, sizes: list[int], axes: list[int], starts: list[int], steps: list[int]
) -> torch.Tensor:
    """The grad of a Slice with positive steps: zeros of the input's shape (`sizes`; -1: that
    dim of `dy`, one the slice took whole) with `dy` written at the sliced positions, as torch's
    slice_backward."""
    out = dy.new_zeros([dy.shape[i] if n < 0 else n for i, n in enumerate(sizes)])
    index: list[slice] = [slice(None)] * out.dim()
    for ax, start, step in zip(axes, starts, steps, strict=True):
        index[ax] = slice(start, start + step * dy.shape[ax], step)
    out[tuple(index)] = dy
    return out


@register("HardSwishGrad", domain="metaopt", fresh_outputs=True)
def hard_swish_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return aten.hardswish_backward(dy, x)


@register("HardSigmoidGrad", domain="metaopt", fresh_outputs=True)
def hard_sigmoid_grad(
    dy: torch.Tensor, x: torch.Tensor, alpha: float = 0.2, beta: float = 0.5
) -> torch.Tensor:
    """The grad of the HardSigmoid row: torch's hardsigmoid_backward for torch's op, else the
    clamp's autograd, op for op (the grad where 0 <= v <= 1, times alpha)."""
    if is_torch_hardsigmoid(alpha, beta):
        return aten.hardsigmoid_backward(dy, x)
    v = x * alpha + beta
    return torch.where((v >= 0) & (v <= 1), dy, 0.0) * alpha


@register("SiluGrad", domain="metaopt", fresh_outputs=True)
def silu_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return aten.silu_backward(dy, x)


@register("QuickGeluGrad", domain="metaopt", fresh_outputs=True)
def quick_gelu_grad(dy: torch.Tensor, x: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    """d/dx of x * sigmoid(alpha * x) = s * (1 + alpha * x * (1 - s)), s = sigmoid(alpha * x)."""
    ax = x * alpha
    s = torch.sigmoid(ax)
    return dy * s * (1 + ax * (1 - s))


@register("RotaryGrad", domain="metaopt", fresh_outputs=True)
def rotary_grad(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """dx of Rotary (x * cos + rotate_half(x) * sin): ``dy * cos`` plus rotate_half's transpose
    of ``dy * sin``, which is ``cat(z2, -z1)`` of its halves. x itself is not read."""
    z = dy * sin
    h = z.shape[-1] // 2
    return dy * cos + torch.cat((z[..., h:], -z[..., :h]), -1)


@register("SiluMulGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True)
def silu_mul_grad(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: list[int] | None = None, _nout: int = 2
):
    """(da, db) of silu(a) * b: silu's own backward on dy * b, and dy * silu(a)."""
    want = [bool(m) for m in (mask or [1] * _nout)] + [False] * 2
    da = aten.silu_backward(dy * b, a) if want[0] else None
    db = dy * torch.nn.functional.silu(a) if want[1] else None
    return (da, db)[:_nout]


@register(
    "BatchNormTrainingGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True, masks_outputs=True
)
def batch_norm_training_grad(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    save_mean: torch.Tensor,
    save_invstd: torch.Tensor,
    epsilon: float = 1e-5,
    mask: list[int] | None = None,
    _nout: int = 3,
):
    """(dx, dscale, dbias) via native_batch_norm_backward (training statistics)."""
    want = [bool(m) for m in (mask or [1, 1, 1])]
    dx, dw, db = aten.native_batch_norm_backward(
        dy, x, scale, None, None, save_mean, save_invstd, True, epsilon, want
    )
    return (dx, dw, db)[:_nout]


@register("LinearGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True, masks_outputs=True)
def linear_grad(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mask: list[int] | None = None, _nout: int = 3
):
    """(dx, dweight, dbias) of F.linear, as autograd's addmm backward forms them on 2-D views;
    `mask` says which are wanted."""
    want = list(mask or [1, 1, 1]) + [0] * 3
    out_f, in_f = weight.shape
    dy2 = dy.reshape(-1, out_f)
    dx = dy.matmul(weight) if want[0] else None
    dw = dy2.t().mm(x.reshape(-1, in_f)) if want[1] else None
    db = dy2.sum(0) if want[2] else None
    return (dx, dw, db)[:_nout]


@register("MatMulGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True, masks_outputs=True)
def matmul_grad(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: list[int] | None = None, _nout: int = 2
):
    """(da, db) of torch.matmul with broadcasting, summed back to each operand's shape
    (operands of rank >= 2; the rule sends 1-D cases to Vjp)."""
    want = list(mask or [1, 1])
    da = dy.matmul(b.transpose(-1, -2)).sum_to_size(a.shape) if want[0] else None
    if not want[1]:
        db = None
    elif a.dim() >= 3 and b.dim() == 2:  # autograd folds the batch into one mm here
        db = a.reshape(-1, a.shape[-1]).t().mm(dy.reshape(-1, dy.shape[-1]))
    else:
        db = a.transpose(-1, -2).matmul(dy).sum_to_size(b.shape)
    return da, db


@register("EmbeddingGrad", domain="metaopt", fresh_outputs=True)
def embedding_grad(
    dy: torch.Tensor,
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: int = 0,
) -> torch.Tensor:
    """The weight grad of a lookup (Gather on axis 0, or our Embedding): what nn.Embedding's
    backward computes, the padding_idx row left zero and counts scaled as torch does.

    `weight` is read for its row count only (a param: alive anyway)."""
    return aten.embedding_dense_backward(dy, indices, weight.shape[0], padding_idx, bool(scale_grad_by_freq))


@register("EmbeddingGradAccumulate", domain="metaopt", inplace=((0, 0),), aliases=SAME)
def embedding_grad_accumulate(
    acc: torch.Tensor, dy: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1
) -> torch.Tensor:
    """EmbeddingGrad + GradAccumulate in one: each looked-up row's grad added straight into
    `acc` (the weight's other grad contribution, storage nothing else reads), so the
    vocab x width grad of the lookup never exists on its own (ops/accumulate.py). Rows equal to
    `padding_idx` get nothing, as nn.Embedding's backward. ``index_put_(accumulate=True)`` is
    deterministic on CUDA too (sorted), unlike ``index_add_``."""
    if not acc.is_contiguous():
        acc = acc.contiguous()  # new storage, as GradAccumulate's fallback
    flat = indices.reshape(-1)
    rows = dy.reshape(flat.numel(), -1).to(acc.dtype)
    if padding_idx >= 0:
        keep = flat != padding_idx
        flat, rows = flat[keep], rows[keep]
    return acc.index_put_((flat,), rows, accumulate=True)


@register("ConvGrad", domain="metaopt", needs_outputs=True, fresh_outputs=True, masks_outputs=True)
def conv_grad(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    strides: list[int] | None = None,
    pads: list[int] | None = None,
    dilations: list[int] | None = None,
    group: int = 1,
    mask: list[int] | None = None,
    memory_format: str = "",
    _nout: int = 3,
):
    """(dx, dw, db) via convolution_backward (symmetric pads only: the rule checks). With the
    forward's `memory_format` it runs in that layout too (the forward's kernel, so the same
    algorithm), and hands `dw` back in `w`'s layout: the update ops read it beside `w`."""
    dy, x = in_memory_format(dy, memory_format), in_memory_format(x, memory_format)
    nd = w.dim() - 2
    strides = strides or [1] * nd
    dilations = dilations or [1] * nd
    padding = (pads or [0] * (2 * nd))[:nd]
    want = [bool(m) for m in (mask or [1] * _nout)] + [False] * 3
    mask = want[:3]
    bias_sizes = [w.shape[0]] if mask[2] else None
    dx, dw, db = aten.convolution_backward(
        dy, x, w, bias_sizes, strides, padding, dilations, False, [0] * nd, group, mask
    )
    if dw is not None and w.is_contiguous() and not dw.is_contiguous():
        dw = dw.contiguous()
    return (dx, dw, db)[:_nout]


@register("SoftmaxCrossEntropyLossGrad", domain="metaopt", fresh_outputs=True)
def softmax_cross_entropy_loss_grad(
    dloss: torch.Tensor,
    log_prob: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """d loss / d scores of SoftmaxCrossEntropyLoss from the forward's log-probabilities:
    the nll_loss backward, then log_softmax's (torch's cross_entropy backward chain),
    without recomputing the softmax over the classes."""
    ignore = NO_IGNORE if ignore_index is None else ignore_index
    with torch.enable_grad():
        lp = log_prob.detach().requires_grad_(True)
        loss = torch.nn.functional.nll_loss(
            lp, labels.to(torch.int64), weights, ignore_index=ignore, reduction=reduction
        )
        (g,) = torch.autograd.grad(loss, lp, dloss)
    return aten._log_softmax_backward_data(g, log_prob, 1, log_prob.dtype)


def _vjp_aliases(op) -> list[tuple[int, int]]:
    # autograd may hand an incoming output grad through (Identity, Add, a view's backward),
    # never a forward input: grads alias grads only.
    n_in = op.attrs["n_in"]
    return [(k, j) for k in range(len(op.outputs)) for j in range(n_in, len(op.inputs))]


@register("Vjp", domain="metaopt", needs_outputs=True, aliases=_vjp_aliases)
def vjp(*args: torch.Tensor | None, op: str, n_in: int, wrt: list[int], n_out: int, _nout: int, **fwd_attrs):
    """Generic gradient: re-run forward kernel `op` on inputs `args[:n_in]` under autograd and
    return d(outputs)/d(inputs[wrt]) applied to the output grads `args[n_in:]` (None = no grad)."""
    row = registry.get(op)
    attrs = {k.removeprefix("f_"): v for k, v in fwd_attrs.items()}
    if row.needs_outputs:
        attrs["_nout"] = n_out
    ins = list(args[:n_in])
    douts = args[n_in:]
    if row.needs_device:
        attrs["_device"] = next(x.device for x in ins if x is not None)
    with torch.enable_grad():
        xs = [ins[i].detach().requires_grad_(True) if i in wrt else ins[i] for i in range(n_in)]
        out = row.kernel(*xs, **attrs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, douts) if g is not None and o is not None and o.requires_grad]
        targets = [xs[i] for i in wrt]
        if not pairs:
            return tuple(torch.zeros_like(t) for t in targets)
        grads = torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, targets))


@register("ReduceGrad", domain="metaopt", aliases=SAME)
def reduce_grad(dy: torch.Tensor, x: torch.Tensor, axes: list[int], keepdims: int = 1, mean: int = 0):
    """ReduceSum's / ReduceMean's grad over axes whose size is known only at run time (`x` is
    read for its shape): dy broadcast back over them, divided by their size for a mean, as
    torch's sum_backward / mean_backward. A view of dy where no division is needed."""
    if not keepdims:
        for a in sorted(axes):
            dy = dy.unsqueeze(a)
    if mean:
        n = 1
        for a in axes:
            n *= x.shape[a]
        dy = dy / n
    return dy.expand(x.shape)


@register("TopKGrad", domain="metaopt", fresh_outputs=True)
def topk_grad(dy: torch.Tensor, indices: torch.Tensor, x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """TopK's input grad from its values' grad: each value's grad at its index along `axis`,
    zeros elsewhere (`x` read for its shape), as torch's value_selecting_reduction_backward."""
    return dy.new_zeros(x.shape).scatter_(axis, indices.to(device=dy.device, dtype=torch.int64), dy)

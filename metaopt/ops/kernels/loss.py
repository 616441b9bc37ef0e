"""Losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (N, C, d1, ..., dk layout)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from metaopt.ops import onnx_bodies
from metaopt.ops.registry import register

# torch's "no ignore index"; ONNX labels are class ids >= 0, so it can never match one.
_NO_IGNORE = -100


def _nll(log_prob: torch.Tensor, target: torch.Tensor, weight, ignore_index, reduction: str) -> torch.Tensor:
    ignore = _NO_IGNORE if ignore_index is None else ignore_index
    return F.nll_loss(log_prob, target.to(torch.int64), weight, ignore_index=ignore, reduction=reduction)


@register("SoftmaxCrossEntropyLoss", needs_outputs=True, amp="black")
def softmax_cross_entropy_loss(
    scores: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    ignore_index: int | None = None,
    reduction: str = "mean",
    _nout: int = 1,
):
    log_prob = torch.log_softmax(scores, 1)
    loss = _nll(log_prob, labels, weights, ignore_index, reduction)
    return (loss, log_prob) if _nout > 1 else loss


@register("NegativeLogLikelihoodLoss", amp="black")
def negative_log_likelihood_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    return _nll(input, target, weight, ignore_index, reduction)


# --- the LM head and its loss, fused and chunked (passes/fuse_linear_cross_entropy.py) -------------
#
# LinearCrossEntropy(x, weight, labels, bias?) = SoftmaxCrossEntropyLoss(x @ W^T + b, labels) with
# x [..., H] flattened to [N, H], W [V, H] (transB=1, F.linear's layout) or [H, V] (transB=0),
# labels flattened to [N]. The logits are made `chunk_size` tokens at a time and dropped once
# their logsumexp and target logit are taken, so no [N, V] tensor ever exists; the gradient
# kernel recomputes each chunk's logits. A chunk's logits come out of the matmul in the inputs'
# dtype (float16/bfloat16 under AMP: what the unfused MatMul produced) and are then read in
# float32, as the unfused program's Cast before the float32 loss did; the loss and the counts
# accumulate in float32 (float64 for float64 inputs).

DEFAULT_CHUNK_TOKENS = 1024


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half inputs (and float32), float64 for float64: what the loss accumulates in."""
    return torch.promote_types(dtype, torch.float32)


def _lce_operands(x, weight, labels, bias, transB):
    """x as [N, H], W as [V, H] (a view), labels as [N] int64, bias as [V] or None."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    y = labels.reshape(-1).to(torch.int64)
    if y.numel() != x2.shape[0]:
        raise ValueError(
            f"LinearCrossEntropy: {x2.shape[0]} tokens in x {tuple(x.shape)} but {y.numel()} labels "
            f"{tuple(labels.shape)}"
        )
    w = weight if transB else weight.t()
    b = None if bias is None else bias.reshape(-1)
    return x2, w, y, b


def _lce_chunk_logits(x2, w, b, y, s, e, ignore_index):
    """One chunk's logits in the accumulation dtype, and its labels' validity mask."""
    logits = F.linear(x2[s:e], w, b)
    z = logits.to(_acc_dtype(logits.dtype))  # no copy for float32 / float64
    t = y[s:e]
    valid = t != ignore_index
    return logits, z, t, valid


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise NotImplementedError(
            f"LinearCrossEntropy: reduction {reduction!r} (only 'mean' and 'sum' are fused; the pass "
            "leaves other reductions unfused)"
        )


def _lce_workspace(attrs: dict, shapes: list, dtypes: list) -> int:
    """Bytes the forward kernel holds besides its inputs and output: one chunk's logits in the
    matmul dtype plus their float32 (accumulation dtype) copy and the logsumexp temporaries."""
    return _lce_chunk_bytes(attrs, shapes, dtypes, copies_low=1)


def _lce_chunk_bytes(attrs: dict, shapes: list, dtypes: list, *, copies_low: int) -> int:
    x, w = shapes[0], shapes[1]
    if x is None or w is None or any(not isinstance(d, int) for d in (*x, *w)):
        return 0
    n = 1
    for d in x[:-1]:
        n *= d
    vocab = w[0] if attrs.get("transB", 1) else w[1]
    chunk = min(n, int(attrs.get("chunk_size", DEFAULT_CHUNK_TOKENS)))
    low = torch.empty((), dtype=_torch_dtype(dtypes[0])).element_size()
    acc = _acc_dtype(_torch_dtype(dtypes[0])).itemsize
    # the float32 copy is the logits themselves when they are float32 already
    return chunk * vocab * ((low * copies_low if low != acc else 0) + acc)


def _torch_dtype(name: str) -> torch.dtype:
    from metaopt.ir import torch_dtype

    return torch_dtype(name)


@register(
    "LinearCrossEntropy",
    domain="metaopt",
    expensive=True,
    amp="white",
    amp_float32_outputs=(0,),
    workspace=_lce_workspace,
    needs_outputs=True,
    onnx_function=onnx_bodies.linear_cross_entropy,
)
def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = _NO_IGNORE,
    reduction: str = "mean",
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    transB: int = 1,
    _nout: int = 1,
):
    """F.cross_entropy(F.linear(x, W, b).flatten(0, -2), labels.flatten(), ignore_index, reduction)
    without the [N, V] logits: `chunk_size` tokens at a time. Mean: over the tokens whose label is
    not `ignore_index` (NaN when there are none, as torch). With more outputs (the backward asked
    for them, float32 / float64 only: ops/grads.py) also the grads of x, W (and b) for a loss grad
    of 1, made in the same pass over the chunks (`_lce_with_unit_grads`)."""
    _check_reduction(reduction)
    if _nout > 1:
        return _lce_with_unit_grads(
            x, weight, labels, bias, ignore_index, reduction, chunk_size, transB, _nout
        )
    x2, w, y, b = _lce_operands(x, weight, labels, bias, transB)
    acc = _acc_dtype(x2.dtype)
    total = torch.zeros((), dtype=acc, device=x.device)
    count = torch.zeros((), dtype=torch.int64, device=x.device)
    n = x2.shape[0]
    for s in range(0, n, chunk_size):
        _, z, t, valid = _lce_chunk_logits(x2, w, b, y, s, min(n, s + chunk_size), ignore_index)
        lse = torch.logsumexp(z, 1)
        # gather at label 0 for ignored rows (any valid index), then masked out
        target = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        total += torch.where(valid, lse - target, 0).sum()
        count += valid.sum()
        del z, lse, target  # one chunk alive at a time
    return total / count if reduction == "mean" else total


def _lce_with_unit_grads(x, weight, labels, bias, ignore_index, reduction, chunk_size, transB, nout):
    """(loss, dx, dW[, db]) with the grads for d loss = 1: each chunk's logits become the loss's
    terms and, in place, their grad (softmax - onehot) / count, which the linear's two matmuls
    turn into dx and dW right away. The backward then only scales them by the loss's actual grad
    (`ScaleGrads`): the logits are made once per step, not again in the backward as
    `LinearCrossEntropyGrad` must (a third of the head's matmul work), and nothing larger than
    the grads themselves lives from here to the backward, which starts right after the loss.
    The loss is computed exactly as with one output. float32 / float64 only: a half-precision
    unit grad would underflow where AMP's loss scale is there to keep it representable."""
    x2, w, y, b = _lce_operands(x, weight, labels, bias, transB)
    if x2.dtype not in (torch.float32, torch.float64) or w.dtype != x2.dtype:
        raise NotImplementedError(
            f"LinearCrossEntropy with its grads in the forward: x {x2.dtype}, weight {w.dtype} (only "
            "float32 / float64 of one dtype; ops/grads.py asks for it only then)"
        )
    n = x2.shape[0]
    valid_all = y != ignore_index
    count = valid_all.sum()
    unit = (
        1.0 / count.to(x2.dtype) if reduction == "mean" else torch.ones((), dtype=x2.dtype, device=x.device)
    )
    zero = torch.zeros((), dtype=x2.dtype, device=x.device)
    total = torch.zeros((), dtype=x2.dtype, device=x.device)
    dx = torch.empty_like(x2)
    dw = torch.zeros(w.shape, dtype=w.dtype, device=x.device)  # [V, H]
    db = torch.zeros(w.shape[0], dtype=x2.dtype, device=x.device) if b is not None else None
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        z = F.linear(x2[s:e], w, b)
        valid = valid_all[s:e]
        t = torch.where(valid, y[s:e], 0)  # any valid index for an ignored row, masked out
        lse = torch.logsumexp(z, 1)
        target = z.gather(1, t.unsqueeze(1)).squeeze(1)
        total += torch.where(valid, lse - target, 0).sum()
        g = z.sub_(lse.unsqueeze(1)).exp_()  # the softmax, in the logits' buffer
        g[torch.arange(e - s, device=x.device), t] -= valid.to(g.dtype)
        g.mul_(torch.where(valid, unit, zero).unsqueeze(1))
        torch.mm(g, w, out=dx[s:e])
        dw.addmm_(g.t(), x2[s:e])
        if db is not None:
            db += g.sum(0)
        del z, g, lse, target  # one chunk alive at a time
    loss = total / count if reduction == "mean" else total
    out_dw = dw if transB else dw.t().contiguous()
    grads = [dx.reshape(x.shape), out_dw] + ([db.reshape(bias.shape)] if db is not None else [])
    return (loss, *grads)[:nout]


def _lce_grad_workspace(attrs: dict, shapes: list, dtypes: list) -> int:
    """The gradient kernel's chunk: the recomputed logits, their float32 softmax and the
    low-precision copy of its gradient the matmuls read; under AMP also the float32 weight-grad
    accumulator and one chunk's low-precision weight-grad product. Shapes are those of its
    inputs (dloss, x, weight, ...)."""
    chunk = _lce_chunk_bytes(attrs, shapes[1:], dtypes[1:], copies_low=2)
    w = shapes[2]
    low = _torch_dtype(dtypes[1])
    if w is None or _acc_dtype(low) == low:
        return chunk
    return chunk + w[0] * w[1] * (_acc_dtype(low).itemsize + low.itemsize)


def lce_grad_start(dloss, x2, w, y, bias, mask, nout: int, ignore_index: int, reduction: str) -> tuple:
    """(the logit grads' scale, dx, dW, db) of a chunked LinearCrossEntropy backward (the plain
    one and the vocab-parallel one): dloss / count under "mean", and zeroed accumulators, in the
    accumulation dtype but dx, for the grads `mask` asks for (None for the others)."""
    want = [bool(m) for m in (mask or [1] * nout)] + [False] * 3
    want[2] = want[2] and bias is not None
    acc = _acc_dtype(x2.dtype)
    scale = dloss.to(acc).reshape(())
    if reduction == "mean":
        scale = scale / (y != ignore_index).sum()
    dx = torch.empty_like(x2) if want[0] else None
    dw = torch.zeros(w.shape, dtype=acc, device=x2.device) if want[1] else None  # [V, H]
    db = torch.zeros(w.shape[0], dtype=acc, device=x2.device) if want[2] else None
    return scale, dx, dw, db


def lce_grad_chunks(
    probs: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    chunk_size: int,
    scale: torch.Tensor,
    w: torch.Tensor,
    x2: torch.Tensor,
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
) -> None:
    """The chunk loop of a chunked LinearCrossEntropy backward (the plain one and the
    vocab-parallel one): `probs(s, e)` gives tokens s:e's (softmax - onehot) in the accumulation
    dtype, and their labels' validity; here they become logit grads (scaled, in the matmul dtype),
    then the linear's backward: dx's rows written, dW and db accumulated (those not None)."""
    n = x2.shape[0]
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        p, valid = probs(s, e)  # no other reference: `del p` below frees it under AMP
        p.mul_(torch.where(valid, scale, 0).unsqueeze(1))
        g = p.to(x2.dtype)  # the matmul dtype (no copy for float32)
        del p
        if dx is not None:
            torch.mm(g, w, out=dx[s:e])
        if dw is not None and dw.dtype == g.dtype:
            dw.addmm_(g.t(), x2[s:e])  # float32 / float64: accumulated by the matmul itself
        elif dw is not None:
            dw += g.t().mm(x2[s:e])  # low precision: each chunk's product summed in float32
        if db is not None:
            db += g.sum(0, dtype=db.dtype)
        del g


def lce_grad_outputs(dx, dw, db, x, weight, bias, nout: int, transB: int = 1) -> tuple:
    """The accumulated grads in their inputs' shapes and dtypes (dW transposed back for transB=0)."""
    out_dx = dx.reshape(x.shape) if dx is not None else None
    out_dw = None
    if dw is not None:
        out_dw = (dw if transB else dw.t()).to(weight.dtype).contiguous()
    out_db = db.to(bias.dtype).reshape(bias.shape) if db is not None else None
    return (out_dx, out_dw, out_db)[:nout]


@register(
    "LinearCrossEntropyGrad",
    domain="metaopt",
    needs_outputs=True,
    fresh_outputs=True,
    workspace=_lce_grad_workspace,
)
def linear_cross_entropy_grad(
    dloss: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = _NO_IGNORE,
    reduction: str = "mean",
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
    transB: int = 1,
    mask: list[int] | None = None,
    _nout: int = 3,
):
    """(dx, dweight, dbias) of LinearCrossEntropy, chunk by chunk with the logits recomputed:
    d loss / d logits = (softmax - onehot(label)) * dloss / count on the non-ignored rows (0 on the
    others), cast to the matmul dtype as the unfused backward's Cast did, then the two matmuls
    of the linear's backward. dW and db accumulate over the chunks in float32 (the accumulation
    dtype) and are cast to their params' dtype at the end; dx is written chunk by chunk."""
    _check_reduction(reduction)
    x2, w, y, b = _lce_operands(x, weight, labels, bias, transB)
    scale, dx, dw, db = lce_grad_start(dloss, x2, w, y, bias, mask, _nout, ignore_index, reduction)

    def probs(s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits, z, t, valid = _lce_chunk_logits(x2, w, b, y, s, e, ignore_index)
        del logits
        p = torch.softmax(z, 1)
        del z
        rows = torch.arange(e - s, device=x.device)
        p[rows, torch.where(valid, t, 0)] -= valid.to(p.dtype)  # subtract the one-hot where valid
        return p, valid

    lce_grad_chunks(probs, chunk_size, scale, w, x2, dx, dw, db)
    return lce_grad_outputs(dx, dw, db, x, weight, bias, _nout, transB)

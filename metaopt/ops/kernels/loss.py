"""Losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (N, C, d1, ..., dk layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

"""GroupedMatMul (the experts' grouped matmul) and its grad kernel against torch, in float64."""

from __future__ import annotations

import pytest
import torch

from metaopt.ops import registry


def _loop(x: torch.Tensor, w: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """The definition, one expert at a time: rows past the last offset stay zero."""
    rows, start = [], 0
    for e, end in enumerate(offsets):
        rows.append(x[start:end] @ w[e])
        start = end
    tail = x.new_zeros(x.shape[0] - start, w.shape[2])
    return torch.cat([*rows, tail])


# (offsets, rows): every expert busy; an empty expert in the middle and at the start; rows that no
# local expert owns (an expert-parallel worker's tail); nothing routed at all
CASES = [([2, 5, 7], 7), ([0, 3, 3, 6], 6), ([1, 1, 4], 6), ([0, 0, 0], 4)]


@pytest.mark.parametrize("offsets,rows", CASES)
def test_forward_and_grads_equal_the_per_expert_loop(offsets, rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(len(offsets), 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    dy = torch.randn(rows, 3, dtype=torch.float64, generator=g)
    off = torch.tensor(offsets, dtype=torch.int32)
    ref = _loop(x, w, offsets)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x, w), dy)
    fwd, bwd = registry.get("GroupedMatMul").kernel, registry.get("GroupedMatMulGrad").kernel
    # the same products in the same order: equal to rounding, tol 1e-12 in float64
    torch.testing.assert_close(fwd(x.detach(), w.detach(), off), ref.detach(), rtol=1e-12, atol=1e-12)
    dx, dw = bwd(dy, x.detach(), w.detach(), off)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-12, atol=1e-12)
    assert bwd(dy, x.detach(), w.detach(), off, mask=[0, 1])[0] is None  # the mask skips dx


def test_torch_grouped_mm_is_the_same_op():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 8, generator=g), torch.randn(3, 8, 4, generator=g)
    off = torch.tensor([2, 2, 5], dtype=torch.int32)
    ours = registry.get("GroupedMatMul").kernel(x, w, off)
    theirs = torch.nn.functional.grouped_mm(x, w, offs=off)
    # float32, different kernels: a few ulps of sums of 8 products
    torch.testing.assert_close(ours[:5], theirs[:5], rtol=1e-5, atol=1e-6)
    assert ours[5].eq(0).all()  # rows past the last offset: zeros (torch leaves them unset)


@pytest.mark.parametrize("offsets", [[3, 2, 6], [1, 2, 9], [1, 2]])
def test_bad_offsets_are_named(offsets):
    x, w = torch.zeros(6, 2), torch.zeros(3, 2, 2)
    with pytest.raises(ValueError, match="GroupedMatMul"):
        registry.get("GroupedMatMul").kernel(x, w, torch.tensor(offsets))


def test_meta_shapes_without_reading_the_routing():
    x, w = torch.empty(6, 4, device="meta"), torch.empty(3, 4, 5, device="meta")
    off = torch.empty(3, dtype=torch.int32, device="meta")
    assert registry.get("GroupedMatMul").kernel(x, w, off).shape == (6, 5)
    dx, dw = registry.get("GroupedMatMulGrad").kernel(torch.empty(6, 5, device="meta"), x, w, off)
    assert dx.shape == x.shape and dw.shape == w.shape

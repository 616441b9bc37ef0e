"""LayerNorm on AMP's mixed inputs (low X, float32 scale): where the kernels refuse the mix (CUDA)
the forward runs on X upcast to float32 (checked on the CPU by taking that path there too); the
backward upcasts on every device."""

from __future__ import annotations

import pytest
import torch

from metaopt.ops.kernels import grad, norm


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_upcast_path_equals_the_mixed_kernel(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 10, 32, generator=g) * 3 + 1).to(dtype)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    dy = torch.randn(6, 10, 32, generator=g).to(dtype)
    mixed = norm.layer_normalization(x, w, b, epsilon=1e-5, _nout=3)
    # the CPU's mixed backward kernel, which LayerNormGrad no longer calls (it upcasts everywhere)
    dmixed = torch.ops.aten.native_layer_norm_backward(dy, x, (32,), mixed[1], mixed[2], w, b, [True] * 3)
    monkeypatch.setattr(norm, "mixed_layer_norm", lambda x, s: x.dtype == s.dtype)
    up = norm.layer_normalization(x, w, b, epsilon=1e-5, _nout=3)
    dup = grad.layer_norm_grad(dy, x, up[1], up[2], w, b)
    assert [t.dtype for t in up] == [t.dtype for t in mixed] == [dtype, torch.float32, torch.float32]
    assert [t.dtype for t in dup] == [dtype, torch.float32, torch.float32]
    # The forward: both compute in float32 from the same exact values and round y to `dtype` once
    # (the CPU's mixed kernel may sum in another order: one ulp of `dtype`; float32 statistics).
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(up[0], mixed[0], rtol=ulp, atol=ulp * 4)
    torch.testing.assert_close(up[1:], mixed[1:], rtol=1e-6, atol=1e-6)
    # The backward against float64 autograd: the upcast path gives dscale / dbias at float32
    # precision, the CPU's mixed kernel rounds them through `dtype` (measured: dbias 1.4e-3
    # relative off there, exact here), so it is held to float32's bar (and to at most the mixed
    # kernel's error, which must be larger: the reason for upcasting on the CPU too).
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.layer_norm(x64, (32,), w64, b64, 1e-5).backward(dy.double())
    for k, truth in enumerate((x64.grad, w64.grad, b64.grad)):
        err_up = (dup[k].double() - truth).abs().max().item()
        err_mixed = (dmixed[k].double() - truth).abs().max().item()
        bar = (ulp if k == 0 else 1e-5) * truth.abs().max().item()
        assert err_up <= max(err_mixed, bar), (k, err_up, err_mixed)
        if k > 0:
            assert err_up <= bar < err_mixed, (k, err_up, bar, err_mixed)

"""MaxPool's gradient rule: the forward also gives its argmax indices and MaxPoolGrad scatters the
grad there (torch's max-pool backward), instead of the generic Vjp that pooled a second time;
ONNX-only geometry (asymmetric pads, column-major indices, ONNX's ceil-mode sizes) falls back to
autograd through the forward kernel. Both against autograd of the forward, float64: equal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metaopt
from metaopt.ops.kernels.nn import max_pool, max_pool_grad

CASES = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},  # ResNet's stem
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "strides": [1, 2], "dilations": [2, 1], "pads": [1, 0, 1, 0]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1]},  # asymmetric: the fallback
    {"kernel_shape": [2, 2], "strides": [1, 1], "storage_order": 1},  # column-major: the fallback
    {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
]


@pytest.mark.parametrize("attrs", CASES)
def test_the_grad_from_the_forward_indices_equals_autograd_of_the_forward(attrs):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64, generator=g)
    y, idx = max_pool(x, **attrs, _nout=2)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=g)
    got = max_pool_grad(dy, x, idx, **attrs)
    xr = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(max_pool(xr, **attrs), xr, dy)
    assert torch.equal(got, want)


class _Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(x)).square().mean()


def test_a_program_uses_the_indices_and_pools_once_with_torchs_grads():
    torch.manual_seed(0)
    module = _Stem()
    x = torch.randn(2, 3, 10, 10)
    p = metaopt.export(module, (x,))
    opt = metaopt.optimizer.SGD(learning_rate=0.0)
    _, params_grads = opt.minimize(p.loss)
    assert [op.type for op in p.ops].count("MaxPool") == 1
    (pool,) = [op for op in p.ops if op.type == "MaxPool"]
    (grad,) = [op for op in p.ops if op.type == "MaxPoolGrad"]
    assert grad.inputs[1:] == [pool.inputs[0], pool.outputs[1]]  # the forward's input and indices
    got = metaopt.Executor("cpu").run(p, feed={"x": x}, fetch_list=[gr for _, gr in params_grads])
    module(x).backward()
    ref = dict(module.named_parameters())
    for (name, _), gr in zip(params_grads, got, strict=True):
        # one max-pool backward on each side: the same scatter, float32 sums in the same order
        torch.testing.assert_close(torch.as_tensor(gr), ref[name].grad, rtol=1e-6, atol=1e-7)

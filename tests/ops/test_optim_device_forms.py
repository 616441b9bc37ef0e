"""The device forms of the optimizer and schedule kernels (ops/kernels/optim.py): what CUDA and
the meta device run, with no host read. Run here on CPU tensors, they are compared with what
they claim to be, bit for bit: torch.optim's fused Adam / AdamW / SGD (the same kernels, on the
CPU too) and the host form of the warm-up schedule (the same float64 operations)."""

from __future__ import annotations

import pytest
import torch

from metaopt.ops.kernels import optim as O

STEPS = 4


def _grads(shape=(5, 3), n=STEPS, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_device_adam_is_torch_fused_adam_bit_for_bit(decoupled, weight_decay, amsgrad):
    p0 = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    ref = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=1e-3, weight_decay=weight_decay, amsgrad=amsgrad, fused=True)
    mine, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    mx = [torch.zeros_like(p0)] if amsgrad else []
    lr = torch.tensor(1e-3, dtype=torch.float64)  # the program's lr var: float64, as torch's Python float
    for k, g in enumerate(_grads()):
        ref.grad = g.clone()
        opt.step()
        step = torch.tensor(k + 1)  # the program's step counter: int64
        O._device_adam([mine], [g], [m], [v], mx, lr, step, None, 0.9, 0.999, 1e-8, weight_decay, decoupled)
    assert torch.equal(mine, ref.detach())
    assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])


@pytest.mark.parametrize("found", [1.0, 2.0])  # 2.0: flags summed over pipeline stages
def test_device_adam_skips_inside_the_kernel_on_a_found_inf(found):
    p, m, v = torch.randn(4), torch.randn(4), torch.rand(4)
    before = [t.clone() for t in (p, m, v)]
    bad = torch.full((4,), float("inf"))
    lr, step = torch.tensor(1e-3, dtype=torch.float64), torch.tensor(3)
    O._device_adam([p], [bad], [m], [v], [], lr, step, torch.tensor(found), 0.9, 0.999, 1e-8, 0.0, False)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before, strict=True))


@pytest.mark.parametrize("momentum,nesterov", [(0.0, 0), (0.9, 0), (0.9, 1)])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-4])
def test_device_sgd_is_torch_fused_sgd_bit_for_bit(momentum, nesterov, weight_decay):
    p0 = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    ref = p0.clone().requires_grad_()
    opt = torch.optim.SGD(
        [ref], lr=0.05, momentum=momentum, nesterov=bool(nesterov), weight_decay=weight_decay, fused=True
    )
    mine = p0.clone()
    bufs = [torch.zeros_like(p0)] if momentum else []  # the optimizer pass starts velocity at zeros
    lr = torch.tensor(0.05, dtype=torch.float64)
    for g in _grads():
        ref.grad = g.clone()
        opt.step()
        O._device_sgd([mine], [g], bufs, lr, None, weight_decay, momentum, 0.0, nesterov)
    assert torch.equal(mine, ref.detach())


def test_device_momentum_with_dampening_is_refused_by_name():
    p, g, buf = torch.zeros(3), torch.ones(3), torch.zeros(3)
    with pytest.raises(NotImplementedError, match=r"dampening=0.5 off the CPU"):
        O._device_sgd([p], [g], [buf], torch.tensor(0.1), None, 0.0, 0.9, 0.5, 0)


@pytest.mark.parametrize("end_lr", [0.0, 1e-5])
def test_the_warmup_schedule_device_form_is_the_host_form_bit_for_bit(end_lr):
    peak, warmup, total = 3e-4, 7, 50
    steps = torch.arange(0, total + 10)
    device = O._device_factor(steps, warmup, total, end_lr / peak) * peak
    host = [peak * O.linear_warmup_decay_factor(int(s), warmup, total, end_lr / peak) for s in steps]
    assert device.dtype == torch.float64
    assert device.tolist() == host

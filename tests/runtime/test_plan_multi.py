"""runtime/plan.py: consecutive update ops run as one multi-tensor call (the row's `multi`,
torch.optim's foreach form), with the per-op kernels' results bit for bit on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import metaopt
from metaopt.ir import names
from metaopt.optimizer import SGD, Adam, AdamW, Momentum
from metaopt.passes.optimize import apply_optimizer
from metaopt.runtime import plan as plan_mod


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)


def _program(optimizer) -> tuple[metaopt.Program, list[str]]:
    torch.manual_seed(0)
    net = _Net()
    p = metaopt.Program("upd")
    params = []
    for name, t in net.named_parameters():
        p.add_var(metaopt.Var(name, "float32", tuple(t.shape), "param", trainable=True), t.detach().clone())
        params.append(name)
    for name in params:
        p.add_var(metaopt.Var(names.grad(name), "float32", p.vars[name].shape, "input"))
        p.inputs.append(names.grad(name))
    q, _ = apply_optimizer(p, optimizer=optimizer, params_grads=[(n, names.grad(n)) for n in params])
    return q, params


def _train(q: metaopt.Program, params: list[str], steps: int = 4) -> dict[str, torch.Tensor]:
    exe = metaopt.Executor("cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        feed = {names.grad(n): torch.randn(q.vars[n].shape, generator=g) for n in params}
        exe.run(q, feed=feed)
    return {k: v.clone() for k, v in exe.scope.items()}, exe


@pytest.mark.parametrize(
    "optimizer",
    [
        Adam(0.01),
        Adam(0.01, weight_decay=0.1, amsgrad=True),
        AdamW(0.01),
        Adam(0.01, fused=True),
        SGD(0.1, weight_decay=0.05),
        Momentum(0.05, nesterov=True, weight_decay=0.01),
        Momentum(0.05),
    ],
    ids=["adam", "adam-wd-amsgrad", "adamw", "fused", "sgd", "nesterov", "momentum"],
)
def test_one_call_equals_the_per_op_kernels(monkeypatch, optimizer):
    q, params = _program(optimizer)
    src = metaopt.Executor("cpu").plan_source(q)
    op_type = next(op.type for op in q.ops if op.role == "optimize")
    assert f"{op_type} x {len(params)} (ops" in src and src.count("multi-tensor call") == 1
    grouped, exe = _train(q, params)
    monkeypatch.setattr(plan_mod, "MULTI_MAX_BYTES", 0)  # nothing fits: one call per op
    assert "multi-tensor" not in metaopt.Executor("cpu").plan_source(q)
    single, exe1 = _train(q, params)
    assert grouped.keys() == single.keys()
    for k in grouped:
        assert torch.equal(grouped[k], single[k]), k
    # the executor's accounting sees the same storages either way
    assert exe.memory_stats()["peak_bytes"] == exe1.memory_stats()["peak_bytes"]


def test_calls_are_chunked_by_param_bytes(monkeypatch):
    q, params = _program(Adam(0.01))
    sizes = [4 * math.prod(q.vars[n].shape) for n in params]  # a.weight, a.bias, b.weight, b.bias
    monkeypatch.setattr(plan_mod, "MULTI_MAX_BYTES", sizes[0] + sizes[1])
    src = metaopt.Executor("cpu").plan_source(q)
    assert src.count("multi-tensor call") == 2 and "x 2 (ops" in src


def test_ops_that_differ_are_not_grouped():
    """Different attrs (a param group's own weight decay) or another learning rate var: separate."""
    q, params = _program(Adam(0.01))
    updates = [op for op in q.ops if op.role == "optimize" and op.type == "AdamUpdate"]
    updates[1].attrs = {**updates[1].attrs, "weight_decay": 0.5}
    src = metaopt.Executor("cpu").plan_source(q)
    # a.weight, then a.bias (its own decay) apart; b.weight and b.bias together
    assert src.count("multi-tensor call") == 1 and "AdamUpdate x 2 (ops" in src

"""LAMB and LARS (Fleet's strategy.lamb / strategy.lars): the update ops against reference
implementations written here from the papers' (and Paddle's) formulas, the fleet steps that
swap them in, and their refusals. Two gloo workers: tests/training/test_sharding_workers.py
(cases "mlp:0:lamb" and "mlp:0:lars", against one process).

The programs take the grads torch autograd computed as inputs (test_optimizers.py's scheme), so
only the update is compared. Tolerance rtol 1e-6 / atol 1e-7: two float32 implementations of the
same formula whose operations are ordered differently (the trust ratio's norms above all)."""

from __future__ import annotations

import pytest
import torch
from conftest import exported
from test_optimizers import STEPS, compute_grads, grads_program, make_model, params_grads

import metaopt
from metaopt import fleet
from metaopt.ir import print_program
from metaopt.passes.layerwise import LayerwiseError, apply_layerwise, plan_layerwise
from metaopt.passes.optimize import apply_optimizer

TOL = {"rtol": 1e-6, "atol": 1e-7}


def reference_lamb(p, g, m, v, t, lr, b1, b2, eps, wd):
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    r = (m / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t)) + eps) + wd * p
    pn, rn = float(p.norm()), float(r.norm())
    trust = pn / rn if pn > 0 and rn > 0 else 1.0
    p.sub_(lr * trust * r)


def reference_lars(p, g, vel, lr, mu, coeff, wd, eps):
    pn, gn = float(p.norm()), float(g.norm())
    local = lr * coeff * pn / (gn + wd * pn + eps) if pn > 0 and gn > 0 else lr
    vel.mul_(mu).add_(local * (g + wd * p))
    p.sub_(vel)


def _run(kind: str, optimizer, attrs: dict, weight_decay: float, exclude: list[str]):
    model = make_model()
    prog = grads_program(model)
    prog, _ = apply_optimizer(prog, optimizer=optimizer, params_grads=params_grads(model))
    plan = plan_layerwise(
        prog,
        kind=kind,
        source=optimizer.update_op_type(),
        attrs=attrs,
        weight_decay=weight_decay,
        exclude=exclude,
    )
    prog = apply_layerwise(prog, plan)
    exe = metaopt.Executor("cpu")
    ref = {n: t.detach().clone() for n, t in model.named_parameters()}
    state = {n: [torch.zeros_like(t), torch.zeros_like(t)] for n, t in ref.items()}
    for step in range(1, STEPS + 1):
        compute_grads(model, step)
        grads = {n: t.grad.clone() for n, t in model.named_parameters()}
        exe.run(prog, feed={f"{n}@GRAD": g for n, g in grads.items()})
        for n, p in ref.items():
            wd = 0.0 if any(x in n for x in exclude) else weight_decay
            if kind == "lamb":
                reference_lamb(
                    p, grads[n], *state[n], step, 0.01, attrs["beta1"], attrs["beta2"], attrs["epsilon"], wd
                )
            else:
                reference_lars(
                    p,
                    grads[n],
                    state[n][0],
                    0.1,
                    attrs["momentum"],
                    attrs["lars_coeff"],
                    wd,
                    attrs["epsilon"],
                )
        with torch.no_grad():  # the next grads at the params both sides hold now
            for n, t in model.named_parameters():
                t.copy_(exe.scope[n])
    return plan, exe, ref


def test_lamb_updates_equal_the_reference_with_excluded_params_undecayed():
    attrs = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6}
    plan, exe, ref = _run("lamb", metaopt.optimizer.Adam(0.01), attrs, 0.01, ["bias"])
    assert plan.op_type == "LambUpdate" and plan.excluded == ["fc1.bias", "fc2.bias"]
    for n, want in ref.items():
        torch.testing.assert_close(exe.scope[n], want, **TOL)


def test_lars_updates_equal_the_reference():
    attrs = {"momentum": 0.9, "lars_coeff": 0.001, "epsilon": 1e-9}
    plan, exe, ref = _run("lars", metaopt.optimizer.Momentum(0.1, momentum=0.9), attrs, 0.0005, [])
    assert plan.op_type == "LarsMomentumUpdate" and plan.excluded == []
    for n, want in ref.items():
        torch.testing.assert_close(exe.scope[n], want, **TOL)


def test_the_pass_refuses_updates_other_than_the_optimizers():
    model = make_model()
    prog, _ = apply_optimizer(
        grads_program(model), optimizer=metaopt.optimizer.SGD(0.1), params_grads=params_grads(model)
    )
    with pytest.raises(LayerwiseError, match="update op SGDUpdate .* is not the optimizer's AdamUpdate"):
        plan_layerwise(prog, kind="lamb", source="AdamUpdate", attrs={}, weight_decay=0.0)


# --- through fleet ----------------------------------------------------------------------------------


def _minimize(optimizer, **flags):
    fleet.init(is_collective=True)
    main = exported("mlp")[2].clone()
    s = fleet.DistributedStrategy()
    for k, v in flags.items():
        setattr(s, k, v)
    opt = fleet.distributed_optimizer(optimizer, s)
    opt.minimize(main.loss)
    return main, opt


def test_fleet_swaps_the_updates_and_reports_the_meta_optimizer(golden):
    main, opt = _minimize(
        metaopt.optimizer.Adam(1e-3), lamb=True, lamb_configs={"exclude_from_weight_decay": ["bias"]}
    )
    assert "lamb" in opt.applied_meta_list
    lamb = [op for op in main.ops if op.type == "LambUpdate"]
    assert len(lamb) == 6 and {op.attrs["weight_decay"] for op in lamb} == {0.0, 0.01}
    golden("layerwise/mlp_lamb", print_program(main))
    main, opt = _minimize(metaopt.optimizer.Momentum(0.1), lars=True)
    assert "lars" in opt.applied_meta_list and sum(op.type == "LarsMomentumUpdate" for op in main.ops) == 6


@pytest.mark.parametrize(
    "optimizer, flags, error, match",
    [
        (
            lambda: metaopt.optimizer.AdamW(1e-3),
            {"lamb": True},
            ValueError,
            "it wraps a metaopt.optimizer.Adam, got AdamW",
        ),
        (lambda: metaopt.optimizer.Adam(1e-3, weight_decay=0.1), {"lamb": True}, ValueError, "would be lost"),
        (lambda: metaopt.optimizer.Momentum(0.1, nesterov=True), {"lars": True}, ValueError, "no nesterov"),
        (
            lambda: metaopt.optimizer.Adam(1e-3),
            {"lamb": True, "lars": True},
            ValueError,
            "cannot be combined",
        ),
        (
            lambda: metaopt.optimizer.Adam(1e-3),
            {"lamb": True, "sharding": True, "sharding_configs": {"sharding_degree": 1}},
            NotImplementedError,
            r"LambUpdate is not elementwise",
        ),
    ],
)
def test_fleet_refuses_by_name(optimizer, flags, error, match):
    with pytest.raises(error, match=match):
        _minimize(optimizer(), **flags)

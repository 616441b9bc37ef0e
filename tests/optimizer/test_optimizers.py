"""Optimizers: update ops bitwise equal to torch.optim (CPU float32), lr schedules, clipping, the pass.

The programs here are hand-built: params plus one program *input* per grad, named
like the grad, fed each step with the grads torch autograd computed on a torch module
holding the same params. Each step the metaopt executor runs the update ops and
torch.optim steps the module; params and optimizer state must then be torch.equal.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import pytest
import torch
from torch import nn

import metaopt
from metaopt.ir import Op, Program, Var, names, parse_program
from metaopt.optimizer import SGD, Adam, AdamW, ClipGradByGlobalNorm, Momentum, lr
from metaopt.passes.optimize import LEARNING_RATE, STEP, apply_optimizer

STEPS = 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def grads_program(model: nn.Module) -> Program:
    """The model's params (trainable) and one input var per grad, named ``p@GRAD``."""
    p = Program("opt")
    for name, t in model.named_parameters():
        p.add_var(Var(name, "float32", tuple(t.shape), "param", trainable=True), t.detach().clone())
    for name, t in model.named_parameters():
        p.add_var(Var(names.grad(name), "float32", tuple(t.shape), "input"))
        p.inputs.append(names.grad(name))
    return p


def params_grads(model: nn.Module) -> list[tuple[str, str]]:
    return [(n, names.grad(n)) for n, _ in model.named_parameters()]


def compute_grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
    model.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()


def train_both(optimizer, make_torch_opt, *, steps=STEPS, clip=None, make_sched=None, check=None):
    """Run `steps` updates with metaopt and torch side by side; compare bitwise after each."""
    model = make_model()
    q, _ = apply_optimizer(grads_program(model), optimizer=optimizer, params_grads=params_grads(model))
    metaopt.verify(q)
    exe = metaopt.Executor("cpu")
    topt = make_torch_opt(model.parameters())
    sched = make_sched(topt) if make_sched else None
    named = dict(model.named_parameters())
    for step in range(steps):
        compute_grads(model, step)
        exe.run(q, feed={names.grad(n): p.grad.detach().clone() for n, p in named.items()})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        used_lr = topt.param_groups[0]["lr"]
        topt.step()
        if sched is not None:
            sched.step()
        assert exe.scope[STEP].item() == step + 1
        assert exe.scope[LEARNING_RATE].item() == used_lr, f"step {step + 1}: learning rate"
        for n, p in named.items():
            assert torch.equal(exe.scope[n], p.detach()), f"step {step + 1}: param {n}"
            state = topt.state[p]
            for key, var in optimizer.state_names(n).items():
                assert torch.equal(exe.scope[var], state[key]), f"step {step + 1}: {var} vs torch {key}"
            if "step" in state:
                assert state["step"].item() == exe.scope[STEP].item()
        if check is not None:
            check(step, exe)
    return q, exe


# --- bitwise equality with torch.optim ------------------------------------------------


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_sgd_bitwise(wd):
    train_both(
        SGD(learning_rate=0.1, weight_decay=wd),
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=wd, foreach=False),
    )


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"dampening": 0.3},
        {"nesterov": True},
        {"momentum": 0.5, "weight_decay": 0.01, "nesterov": True},
        {"momentum": 0.8, "dampening": 0.1, "weight_decay": 0.02},
        {"momentum": 0.0},  # torch.optim.SGD without a buffer
    ],
)
def test_momentum_bitwise(kw):
    opt = Momentum(learning_rate=0.05, **kw)
    tkw = {"momentum": kw.get("momentum", 0.9), **{k: v for k, v in kw.items() if k != "momentum"}}
    q, _ = train_both(opt, lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=False, **tkw))
    want = "SGDUpdate" if kw.get("momentum", 0.9) == 0 else "MomentumUpdate"
    assert [op.type for op in q.ops if op.role == "optimize"] == [want] * 4


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"weight_decay": 0.1},
        {"amsgrad": True},
        {"amsgrad": True, "weight_decay": 0.1, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6},
    ],
)
def test_adam_bitwise(kw):
    tkw = {k: v for k, v in kw.items() if k not in ("beta1", "beta2", "epsilon")}
    tkw["betas"] = (kw.get("beta1", 0.9), kw.get("beta2", 0.999))
    tkw["eps"] = kw.get("epsilon", 1e-8)
    train_both(Adam(learning_rate=0.01, **kw), lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False, **tkw))


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.0}, {"weight_decay": 0.2, "amsgrad": True}])
def test_adamw_bitwise(kw):
    train_both(
        AdamW(learning_rate=0.01, **kw), lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False, **kw)
    )


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1}, {"amsgrad": True, "weight_decay": 0.05}])
def test_fused_adam_bitwise_with_torchs_fused(cls, kw):
    """fused=True is torch.optim's fused kernel: bitwise equal to torch.optim.Adam(fused=True),
    every state var included (and printed as an attr of the update ops)."""
    ours = {"Adam": Adam, "AdamW": AdamW}[cls](learning_rate=0.01, fused=True, **kw)
    theirs = getattr(torch.optim, cls)
    q, _ = train_both(ours, lambda ps: theirs(ps, lr=0.01, fused=True, **kw))
    assert all(op.attrs["fused"] == 1 for op in q.ops if op.role == "optimize")


def test_fused_adam_is_not_the_default_kernel():
    """The check above can tell the two kernels apart: fused and single-tensor Adam differ in the
    last bit within a few steps (so the default stays the single-tensor form, torch's default)."""
    with pytest.raises(AssertionError, match="step"):
        train_both(
            Adam(learning_rate=0.01, fused=True), lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False)
        )


def test_adamw_default_weight_decay_is_torchs():
    assert AdamW().weight_decay == 0.01 == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]
    assert Adam().weight_decay == 0.0


@pytest.mark.parametrize("clip_norm", [0.05, 1e3])  # active on every step / never active
def test_clip_by_global_norm_bitwise(clip_norm):
    train_both(
        Adam(learning_rate=0.01, weight_decay=0.1, grad_clip=ClipGradByGlobalNorm(clip_norm)),
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=False),
        clip=clip_norm,
    )


def test_clip_then_momentum_bitwise():
    train_both(
        Momentum(learning_rate=0.1, weight_decay=0.01, grad_clip=ClipGradByGlobalNorm(0.1)),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False),
        clip=0.1,
    )


def test_clip_op_is_one_op_over_all_grads():
    model = make_model()
    opt = SGD(0.1, grad_clip=ClipGradByGlobalNorm(1.0))
    q, ops = apply_optimizer(grads_program(model), optimizer=opt, params_grads=params_grads(model))
    (clip,) = [op for op in q.ops if op.type == "ClipByGlobalNorm"]
    assert clip.inputs == [g for _, g in params_grads(model)]
    assert clip.outputs == [names.clipped(g) for _, g in params_grads(model)]
    assert ops[0] is clip and clip.role == "optimize"
    for op in ops[1:]:
        assert op.inputs[1] == names.clipped(names.grad(op.origin))


# --- learning-rate schedules ------------------------------------------------------------


def hf_linear_lambda(warmup: int, total: int):
    """transformers.get_linear_schedule_with_warmup's lambda, verbatim."""

    def lr_lambda(current_step: int) -> float:
        if current_step < warmup:
            return float(current_step) / float(max(1, warmup))
        return max(0.0, float(total - current_step) / float(max(1, total - warmup)))

    return lr_lambda


def test_linear_warmup_decay_matches_lambda_lr():
    # 9 updates: 3 warmup (the first at lr 0, as torch's LambdaLR), decay to 0 at 7, then 0.
    sched = lr.LinearWarmupDecay(0.02, warmup_steps=3, total_steps=7)
    seen = []
    train_both(
        AdamW(learning_rate=sched),
        lambda ps: torch.optim.AdamW(ps, lr=0.02, foreach=False),
        steps=9,
        make_sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, hf_linear_lambda(3, 7)),
        check=lambda step, exe: seen.append(exe.scope[LEARNING_RATE].item()),
    )
    assert seen == [sched.lr_at(k) for k in range(9)]
    assert seen[0] == 0.0 and seen[3] == 0.02 and seen[7:] == [0.0, 0.0]


def test_linear_warmup_decay_end_lr():
    sched = lr.LinearWarmupDecay(1e-3, warmup_steps=2, total_steps=6, end_lr=1e-4)
    want = [0.0, 5e-4, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4, 1e-4]
    got = [sched.lr_at(k) for k in range(9)]
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18) for a, b in zip(got, want, strict=True)), got
    # the program computes the same rates, bitwise (the kernel and lr_at share one function)
    train_both(
        SGD(learning_rate=sched),
        lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=False),
        steps=9,
        make_sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, sched.lr_lambda),
    )


def test_schedule_ops_have_role_lr_sched():
    model = make_model()
    opt = Adam(lr.LinearWarmupDecay(1e-3, 2, 10))
    q, ops = apply_optimizer(grads_program(model), optimizer=opt, params_grads=params_grads(model))
    sched_ops = [op for op in q.ops if op.role == "lr-sched"]
    assert [op.type for op in sched_ops] == ["StepCounter", "LinearWarmupDecayLR"]
    assert q.updates[LEARNING_RATE] == names.new_state(LEARNING_RATE)
    assert all(op.inputs[2] == names.new_state(LEARNING_RATE) for op in ops)
    assert not any(op in ops for op in sched_ops)


def test_learning_rate_var_can_be_changed_in_scope():
    model = make_model()
    q, _ = apply_optimizer(grads_program(model), optimizer=SGD(0.1), params_grads=params_grads(model))
    exe = metaopt.Executor("cpu")
    topt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    named = dict(model.named_parameters())
    for step, rate in enumerate([0.1, 0.5, 0.0, 0.25]):
        if step:
            exe.scope[LEARNING_RATE].fill_(rate)
            topt.param_groups[0]["lr"] = rate
        before = {n: exe.scope[n].clone() for n in named} if step else None
        compute_grads(model, step)
        exe.run(q, feed={names.grad(n): p.grad.detach().clone() for n, p in named.items()})
        topt.step()
        for n, p in named.items():
            assert torch.equal(exe.scope[n], p.detach()), (step, n)
            if rate == 0.0:
                assert torch.equal(exe.scope[n], before[n])
    assert exe.scope[LEARNING_RATE].dtype == torch.float64


# --- the pass: purity, fields, state vars ------------------------------------------------


def test_pass_is_pure():
    model = make_model()
    p = grads_program(model)
    text, values, updates = str(p), dict(p.values), dict(p.updates)
    opt = AdamW(lr.LinearWarmupDecay(1e-3, 1, 3), amsgrad=True, grad_clip=ClipGradByGlobalNorm(1.0))
    q, _ = apply_optimizer(p, optimizer=opt, params_grads=params_grads(model))
    assert str(p) == text and p.values.keys() == values.keys() and p.updates == updates
    assert all(p.values[k] is v for k, v in values.items())
    assert q is not p and len(q.ops) == 1 + 1 + 1 + 4 and not p.ops
    q2, _ = apply_optimizer(p, optimizer=opt, params_grads=params_grads(model))
    assert str(q2) == str(q)  # deterministic


def test_update_ops_fields_and_state_vars():
    model = make_model()
    opt = Adam(0.01, amsgrad=True)
    q, ops = apply_optimizer(grads_program(model), optimizer=opt, params_grads=params_grads(model))
    assert [op.origin for op in ops] == [n for n, _ in model.named_parameters()]
    for op in ops:
        assert op.type == "AdamUpdate" and op.role == "optimize"
        p = op.origin
        states = [names.moment(p, 1), names.moment(p, 2), names.max_moment(p, 2)]
        assert op.inputs == [p, names.grad(p), LEARNING_RATE, names.new_state(STEP), *states]
        assert op.outputs == [names.new_state(x) for x in [p, *states]]
        for s in [p, *states]:
            assert q.updates[s] == names.new_state(s)
        for s in states:
            v = q.vars[s]
            assert v.kind == "opt_state" and v.persistable and v.shape == q.vars[p].shape
            assert torch.equal(q.values[s], torch.zeros(v.shape))
    for name, dtype in [(STEP, "int64"), (LEARNING_RATE, "float64")]:
        v = q.vars[name]
        assert (v.kind, v.persistable, v.shape, v.dtype) == ("opt_state", True, (), dtype)
    assert q.values[LEARNING_RATE].item() == 0.01 and q.values[STEP].item() == 0
    # printed, parsed back, verified
    assert str(parse_program(str(q))) == str(q)
    metaopt.verify(q)
    exe = metaopt.Executor("cpu")
    exe.run(q, feed={g: torch.ones(q.vars[g].shape) for _, g in params_grads(model)})
    state_vars = {v.name for v in q.vars.values() if v.kind == "opt_state"}
    assert len(state_vars) == 2 + 3 * 4 and state_vars <= set(exe.scope)
    assert exe.scope[STEP].item() == 1


def test_update_ops_write_only_their_own_state_in_place():
    """Update rows declare `inplace`: param and state are updated in their own storage
    (as torch.optim does); the grads (here feeds) are never written."""
    model = make_model()
    for opt in [
        Momentum(0.1, nesterov=True, weight_decay=0.1, grad_clip=ClipGradByGlobalNorm(0.01)),
        AdamW(0.1, amsgrad=True, weight_decay=0.1),
        Adam(lr.LinearWarmupDecay(0.1, 1, 4), weight_decay=0.1),
    ]:
        q, _ = apply_optimizer(grads_program(model), optimizer=opt, params_grads=params_grads(model))
        exe = metaopt.Executor("cpu")
        for step in range(3):
            feed = {g: torch.randn(q.vars[g].shape) for _, g in params_grads(model)}
            feed_copy = {k: v.clone() for k, v in feed.items()}
            held = dict(exe.scope)
            exe.run(q, feed=feed)
            assert all(torch.equal(feed[k], feed_copy[k]) for k in feed), (opt, step)
            in_place = [k for k in held if k not in ("global_step", "learning_rate")]
            assert all(exe.scope[k] is held[k] for k in in_place), (opt, step)


def test_state_names_are_fleet_like():
    assert names.moment("fc1.weight", 1) == "fc1.weight@MOMENT1"
    assert names.moment("fc1.weight", 2) == "fc1.weight@MOMENT2"
    assert names.max_moment("fc1.weight", 2) == "fc1.weight@MAX_MOMENT2"
    assert names.velocity("fc1.weight") == "fc1.weight@VELOCITY"
    assert names.clipped("fc1.weight@GRAD") == "fc1.weight@GRAD@CLIP"
    assert Momentum().state_names("w") == {"momentum_buffer": "w@VELOCITY"}
    assert list(AdamW(amsgrad=True).state_names("w")) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    assert SGD().state_names("w") == {}


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: SGD(learning_rate=-0.1), ValueError, "learning_rate must be a finite number >= 0, got -0.1"),
        (lambda: Adam(learning_rate="0.1"), TypeError, "learning_rate must be a float"),
        (lambda: Adam(beta1=1.0), ValueError, r"beta1 must be in \[0.0, 1.0\), got 1.0"),
        (lambda: AdamW(beta2=-0.5), ValueError, "beta2 must be in"),
        (lambda: Adam(epsilon=-1e-8), ValueError, "epsilon must be >= 0.0"),
        (lambda: SGD(weight_decay=float("nan")), ValueError, "weight_decay must be >= 0.0, got nan"),
        (lambda: Momentum(momentum=-0.9), ValueError, "momentum must be >= 0.0"),
        (lambda: Momentum(nesterov=True, dampening=0.1), ValueError, "nesterov momentum requires"),
        (lambda: Momentum(momentum=0.0, nesterov=True), ValueError, "nesterov momentum requires"),
        (lambda: SGD(grad_clip=1.0), TypeError, "grad_clip must be a metaopt.optimizer.ClipGradByGlobalNorm"),
        (lambda: ClipGradByGlobalNorm(0.0), ValueError, "clip_norm must be a finite number > 0"),
        (lambda: lr.LinearWarmupDecay(1e-3, 10, 5), ValueError, r"total_steps \(5\) must be >= warmup_steps"),
        (lambda: lr.LinearWarmupDecay(1e-3, 1, 5, end_lr=1e-2), ValueError, "end_lr"),
        (lambda: lr.LinearWarmupDecay(-1e-3, 1, 5), ValueError, "peak_lr must be a finite number >= 0"),
        (lambda: lr.LinearWarmupDecay(1e-3, 1.5, 5), TypeError, "warmup_steps must be an int"),
    ],
)
def test_bad_config_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_params_grads_errors():
    model = make_model()
    p = grads_program(model)
    p.add_var(Var("frozen", "float32", (2,), "param", trainable=False), torch.zeros(2))
    p.add_var(Var("small", "float32", (3,), "input"))
    opt = SGD(0.1)
    cases = [
        ([("fc1.weigth", "fc1.weight@GRAD")], r"no param 'fc1.weigth' \(did you mean 'fc1.weight'"),
        (
            [("fc1.weight", "fc1.weight@GRAF")],
            r"no grad var 'fc1.weight@GRAF'.*did you mean 'fc1.weight@GRAD'",
        ),
        ([("fc1.weight@GRAD", "fc1.weight@GRAD")], r"'fc1.weight@GRAD' is not a param \(kind input\)"),
        ([("frozen", "small")], "param 'frozen' is frozen"),
        ([("fc1.bias", "small")], r"grad 'small' is float32\[3\] but param 'fc1.bias' is float32\[8\]"),
        ([("fc1.bias", "fc1.bias@GRAD")] * 2, "param 'fc1.bias' appears twice"),
        ([], "params_grads is empty"),
    ]
    for pg, match in cases:
        with pytest.raises(ValueError, match=match):
            apply_optimizer(p, optimizer=opt, params_grads=pg)
    with pytest.raises(TypeError, match="must be a metaopt.optimizer"):
        apply_optimizer(p, optimizer=torch.optim.SGD, params_grads=params_grads(model))
    q, _ = apply_optimizer(p, optimizer=opt, params_grads=[("fc1.bias", "fc1.bias@GRAD")])
    with pytest.raises(ValueError, match="already updated by 'fc1.bias@NEW'"):
        apply_optimizer(q, optimizer=opt, params_grads=[("fc1.bias", "fc1.bias@GRAD")])
    with pytest.raises(ValueError, match="already has a var 'global_step' .an optimizer was already applied"):
        apply_optimizer(q, optimizer=opt, params_grads=[("fc2.bias", "fc2.bias@GRAD")])


# --- Fleet's API: apply_gradients and minimize rewrite the program in place --------------


def test_apply_gradients_in_place():
    model = make_model()
    p = grads_program(model)
    version = p.version
    with pytest.raises(ValueError, match="pass program="):
        SGD(0.1).apply_gradients(params_grads(model))
    pg = [(p.var(a), p.var(b)) for a, b in params_grads(model)]  # Vars: the program is inferred
    ops = SGD(0.1).apply_gradients(pg)
    assert p.version == version + 1 and all(op in p.ops for op in ops)
    assert [op.origin for op in ops] == [n for n, _ in model.named_parameters()]


def tiny_program() -> Program:
    """loss = sum(x * w): d loss / d w = x."""
    p = Program("tiny")
    p.add_var(Var("x", "float32", (3,), "input"))
    p.add_var(Var("w", "float32", (3,), "param", trainable=True), torch.tensor([1.0, 2.0, 3.0]))
    p.add_var(Var("h", "float32", (3,)))
    p.add_var(Var("loss", "float32", ()))
    p.ops += [Op("Mul", ["x", "w"], ["h"]), Op("ReduceSum", ["h"], ["loss"], {"keepdims": 0}, role="loss")]
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    return p


def test_minimize_rewrites_the_loss_program_in_place(monkeypatch):
    calls = []

    def fake_append_backward(program, *, loss, parameter_list=None, no_grad_set=None):
        calls.append((loss, parameter_list, no_grad_set))
        q = program.clone()
        q.add_var(Var(names.grad("w"), "float32", (3,), "grad"))
        q.ops.append(Op("Identity", ["x"], [names.grad("w")], role="backward", origin="w"))
        return q, [("w", names.grad("w"))]

    fake = types.ModuleType("metaopt.passes.backward")
    fake.append_backward = fake_append_backward
    fake.loss_grad_seed = lambda program, loss: None  # the backward step records its seed
    monkeypatch.setitem(sys.modules, "metaopt.passes.backward", fake)
    p = tiny_program()
    w = p.var("w")
    ops, pg = SGD(0.5).minimize(p.loss, parameter_list=[w], no_grad_set={"x"})
    assert calls == [("loss", ["w"], ["x"])]
    assert pg == [("w", "w@GRAD")]
    assert [op.type for op in ops] == ["SGDUpdate"] and ops[0] is p.ops[-1]
    assert [op.role for op in p.ops] == ["forward", "loss", "backward", "lr-sched", "optimize"]
    exe = metaopt.Executor("cpu")
    (loss,) = exe.run(p, feed={"x": torch.tensor([1.0, 0.0, -2.0])}, fetch_list=[p.loss])
    assert float(loss) == 1.0 - 6.0
    assert torch.equal(exe.scope["w"], torch.tensor([0.5, 2.0, 4.0]))
    with pytest.raises(TypeError, match="loss must be a metaopt Var"):
        SGD().minimize("loss")


@pytest.mark.skipif(
    importlib.util.find_spec("metaopt.passes.backward") is None, reason="append_backward not written yet"
)
def test_minimize_with_append_backward_trains_like_torch():
    """Exported MLP, real backward, 3 Adam steps vs torch (grads differ in rounding: DESIGN's rtol)."""
    model = make_model()

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x, y):
            return ((self.m(x) - y) ** 2).mean()

    wrapped = WithLoss()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
    main = metaopt.export(wrapped, (x, y))
    opt_ops, pg = Adam(0.01).minimize(main.loss)
    assert {op.origin for op in opt_ops} == {n for n, _ in wrapped.named_parameters()}
    exe = metaopt.Executor("cpu")
    topt = torch.optim.Adam(wrapped.parameters(), lr=0.01, foreach=False)
    for _ in range(3):
        exe.run(main, feed={"x": x, "y": y}, fetch_list=[main.loss])
        topt.zero_grad()
        wrapped(x, y).backward()
        topt.step()
    for n, t in wrapped.named_parameters():
        torch.testing.assert_close(exe.scope[n], t.detach(), rtol=1e-5, atol=4e-5)


def test_minimize_verifies_each_pass_and_names_the_one_that_broke_an_invariant(monkeypatch):
    """Optimizer.minimize runs two passes; a program either leaves invalid is a StepError naming
    that pass, and the user's program is left as it was."""
    from metaopt.passes import optimize
    from metaopt.passes.driver import StepError

    p = Program("tiny")
    p.add_var(Var("x", "float32", ("batch", 3), kind="input"))
    p.add_var(Var("w", "float32", (3,), kind="param", trainable=True), torch.ones(3))
    p.add_var(Var("h", "float32", ("batch", 3)))
    p.add_var(Var("loss", "float32", ()))
    p.ops += [Op("Mul", ["x", "w"], ["h"]), Op("ReduceSum", ["h"], ["loss"], {"keepdims": 0}, role="loss")]
    p.inputs, p.outputs, p.loss_name = ["x"], ["loss"], "loss"
    before = str(p)
    real = optimize.apply_optimizer

    def broken(program, **kw):
        q, ops = real(program, **kw)
        q.ops.append(Op("Relu", ["nowhere"], ["h2"]))  # reads a var nothing defines
        q.add_var(Var("h2", "float32", ("batch", 3)))
        return q, ops

    monkeypatch.setattr(optimize, "apply_optimizer", broken)
    with pytest.raises(StepError, match=r"step 'apply_optimizer' broke an invariant of 'tiny'.*nowhere"):
        metaopt.optimizer.SGD(0.1).minimize(p.loss)
    assert str(p) == before

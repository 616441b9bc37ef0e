"""The AMP meta optimizer: overflow skipping, Fleet's scale rule, loss curves, recompute, DP."""

from __future__ import annotations

import functools
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import exported
from workers import start_workers, wait_workers

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import Op, Var, parse_program, verify
from metaopt.ops import registry
from metaopt.passes.amp import AmpError, amp, scale_loss, unscale_grads

HERE = Path(__file__).parent


def _strategy(amp_configs: dict | None = None, recompute: list[str] | None = None, offload=False):
    s = fleet.DistributedStrategy()
    s.amp = True
    s.amp_configs = amp_configs or {}
    if recompute:
        s.recompute = True
        s.recompute_configs = {"checkpoints": recompute, "enable_offload": offload}
    return s


def _train(name: str, strategy, dropout: float = 0.0, optimizer=None):
    fleet.init(is_collective=True)
    main = exported(name, dropout=dropout)[2].clone()
    opt = fleet.distributed_optimizer(optimizer or metaopt.optimizer.Adam(learning_rate=1e-3), strategy)
    result = opt.minimize(main.loss)
    verify(main)
    return main, opt, result


def _feed(name: str, step: int) -> dict:
    mod = programs.get(name)
    return dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=step), strict=True))


def _run(program, name: str, steps: int, seed: int = 0, exe=None, start: int = 0):
    exe = exe or metaopt.Executor("cpu")
    metaopt.seed(seed)
    losses = [
        exe.run(program, feed=_feed(name, start + s), fetch_list=[program.loss], return_numpy=False)[0]
        for s in range(steps)
    ]
    return losses, exe


# --- Fleet's loss-scaling rule ------------------------------------------------------------


def _fleet_rule(found: list[bool], scale: float, incr_n: int, decr_n: int, incr: float, decr: float):
    """Paddle's update_loss_scaling (operators/amp/update_loss_scaling_op.h), step by step, in
    its float32 arithmetic (``T new_scale = pre_scale * decr_ratio`` with a float attribute)."""
    f32 = np.float32
    scale = f32(scale)
    good = bad = 0
    out = []
    for f in found:
        if f:
            good, bad = 0, bad + 1
            if bad == decr_n:
                scale, bad = max(scale * f32(decr), f32(1.0)), 0
        else:
            good, bad = good + 1, 0
            if good == incr_n:
                with np.errstate(over="ignore"):
                    up = scale * f32(incr)
                scale, good = (up if np.isfinite(up) else scale), 0
        out.append((float(scale), good, bad))
    return out


def test_update_loss_scaling_kernel_follows_fleets_rule():
    """200 random steps (30% overflow), plus the floor at 1 and a growth that would overflow."""
    kernel = registry.get("UpdateLossScaling").kernel
    rng = random.Random(0)
    cases = [
        ([rng.random() < 0.3 for _ in range(200)], 1024.0, 3, 2, 2.0, 0.5),
        ([True] * 30, 8.0, 1000, 1, 2.0, 0.8),  # shrinks to the floor of 1
        ([False] * 6, 2.0**126, 2, 2, 4.0, 0.5),  # 2**128 is not a float32: kept
    ]
    for found, scale0, incr_n, decr_n, incr, decr in cases:
        want = _fleet_rule(found, scale0, incr_n, decr_n, incr, decr)
        scale = torch.tensor(scale0)
        good = bad = torch.zeros((), dtype=torch.int32)
        for f, (ws, wg, wb) in zip(found, want, strict=True):
            rule = {"incr_every_n_steps": incr_n, "decr_every_n_nan_or_inf": decr_n}
            scale, good, bad = kernel(
                torch.tensor(f), scale, good, bad, **rule, incr_ratio=incr, decr_ratio=decr
            )
            assert (scale.item(), good.item(), bad.item()) == (ws, wg, wb)
    assert want[-1][0] == 2.0**126


# --- overflow handling ---------------------------------------------------------------------


def _poisoned_mlp(configs: dict) -> metaopt.Program:
    """amp + scale_loss + Adam + one grad (fc2.bias) multiplied by a fed `poison` scalar, then
    the check: an inf in exactly one grad on the step where poison is inf."""
    p = scale_loss(amp(exported("mlp")[2], dtype="float16"), init_loss_scaling=configs["init_loss_scaling"])
    metaopt.optimizer.Adam(learning_rate=1e-2).minimize(p.var("loss@SCALED"))
    first = next(i for i, op in enumerate(p.ops) if op.role in ("optimize", "lr-sched"))
    p.add_var(Var("poison", "float32", (), "input"))
    p.inputs.append("poison")
    g = "fc2.bias@GRAD"
    p.add_var(Var("fc2.bias@GRAD@POISONED", "float32", (32,), "grad"))
    p.ops.insert(first, Op("Mul", [g, "poison"], ["fc2.bias@GRAD@POISONED"], role="backward", origin=g))
    for op in p.ops[first + 1 :]:
        op.inputs = ["fc2.bias@GRAD@POISONED" if x == g else x for x in op.inputs]
    rule = {k: v for k, v in configs.items() if k != "init_loss_scaling"}
    q = unscale_grads(p, **rule)
    verify(q)
    return q


def test_an_inf_in_one_grad_skips_exactly_that_step():
    configs = {
        "init_loss_scaling": 1024.0,
        "incr_every_n_steps": 2,
        "decr_every_n_nan_or_inf": 1,
        "incr_ratio": 2.0,
        "decr_ratio": 0.5,
    }
    program = _poisoned_mlp(configs)
    poisoned = {2, 5}
    exe = metaopt.Executor("cpu")
    state_names = [v.name for v in program.persistables() if v.kind in ("param", "opt_state")]
    before = None
    scales, skipped = [], []
    for step in range(8):
        feed = {**_feed("mlp", step), "poison": torch.tensor(float("inf") if step in poisoned else 1.0)}
        loss, found = exe.run(program, feed=feed, fetch_list=["loss", "found_inf"], return_numpy=False)
        assert torch.isfinite(loss)  # the forward is clean: only the one grad is poisoned
        after = {k: exe.scope[k].clone() for k in state_names if k in exe.scope}
        if before is not None:
            changed = [k for k in after if not torch.equal(after[k], before[k])]
            if step in poisoned:  # params, moments, step counter: all untouched (only the scale moved)
                assert set(changed) <= {"loss_scaling", "num_good_steps", "num_bad_steps"}, changed
            else:
                assert {"fc1.weight", "fc2.bias", "fc2.bias@MOMENT1", "global_step"} <= set(changed)
        skipped.append(bool(found))
        scales.append(exe.scope["loss_scaling"].item())
        before = after
    assert skipped == [s in poisoned for s in range(8)]
    assert exe.scope["global_step"].item() == 8 - len(poisoned)
    want = [s for s, _, _ in _fleet_rule(skipped, 1024.0, 2, 1, 2.0, 0.5)]
    assert scales == want
    # halved on the skipped step, then recovered after incr_every_n_steps good ones
    assert scales[1:5] == [2048.0, 1024.0, 1024.0, 2048.0]


# --- a stalling loss scale warns (issue 17) --------------------------------------------------------

_HALVING = {"incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 1, "incr_ratio": 2.0, "decr_ratio": 0.5}


def _amp_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "metaopt.amp" and r.levelname == "WARNING"]


def _run_poisoned(program, exe, steps, poisoned) -> None:
    for step in steps:
        feed = {**_feed("mlp", step), "poison": torch.tensor(float("inf") if step in poisoned else 1.0)}
        exe.run(program, feed=feed, fetch_list=["loss"])


def test_a_collapsing_loss_scale_warns_naming_the_first_non_finite_grad(caplog):
    """Occasional overflows are the scaler's job: silent. A grad that stays inf skips every
    step: a warning at the first skip with the scale at its floor of 1, at the 10th skip in a
    row and the 20th, each naming the grad; a finite step ends the run of skips."""
    from metaopt.ops.kernels.amp import SKIPS_IN_A_ROW_WARN

    assert SKIPS_IN_A_ROW_WARN == 10
    program = _poisoned_mlp({"init_loss_scaling": 1024.0, **_HALVING})
    exe = metaopt.Executor("cpu")
    caplog.set_level("WARNING", logger="metaopt.amp")
    _run_poisoned(program, exe, range(8), poisoned={2, 3, 5})
    assert _amp_warnings(caplog) == []
    assert exe.scope["loss_scaling"].item() == 128.0  # 1024 halved by the three skips
    _run_poisoned(program, exe, range(8, 28), poisoned=range(8, 100))
    got = _amp_warnings(caplog)
    assert len(got) == 3, got
    # the 8th skip runs at 128 / 2**7 = 1: the floor; then the 10th and the 20th in a row
    assert [t.split(" in a row")[0] for t in got] == [f"AMP skipped {n} steps" for n in (8, 10, 20)]
    for text in got:
        assert "1 of 6 grads not finite, the first the backward made: 'fc2.bias@GRAD@POISONED'" in text
        assert "loss scale 1 this step (now 1; 128 at the first skip of this run)" in text
        assert "The scale is <= 1, where Fleet's rule stops shrinking it" in text
    assert exe.scope["loss_scaling"].item() == 1.0
    caplog.clear()
    _run_poisoned(program, exe, range(30, 30 + SKIPS_IN_A_ROW_WARN), poisoned={31, 32})
    assert _amp_warnings(caplog) == []  # a finite step ended the run of skips


def test_static_loss_scaling_warns_when_every_step_is_skipped(caplog):
    """use_dynamic_loss_scaling=False: nothing shrinks a scale that is too large, so the grads
    overflow every step (a scale of 2**100 makes the float16 grads inf)."""
    from metaopt.ops.kernels.amp import SKIPS_IN_A_ROW_WARN

    main, _, _ = _train("mlp", _strategy({"use_dynamic_loss_scaling": False, "init_loss_scaling": 2.0**100}))
    caplog.set_level("WARNING", logger="metaopt.amp")
    _, exe = _run(main, "mlp", SKIPS_IN_A_ROW_WARN)
    assert exe.scope["global_step"].item() == 0  # every step skipped
    (text,) = _amp_warnings(caplog)
    assert text.startswith(f"AMP skipped {SKIPS_IN_A_ROW_WARN} steps in a row") and "@GRAD'" in text
    assert f"loss scale {2.0**100:g} this step" in text


def test_the_passes_refuse_a_scale_or_rule_that_skips_forever():
    p = amp(exported("mlp")[2], dtype="float16")
    for bad in (float("inf"), float("nan"), 0.0, -1.0, 1e39, 1e-40):
        want = rf"init_loss_scaling must be a finite float32 > 0 .*got {re.escape(repr(bad))}"
        with pytest.raises(AmpError, match=want):
            scale_loss(p, init_loss_scaling=bad)
    q = scale_loss(p, init_loss_scaling=8.0)
    metaopt.optimizer.SGD(learning_rate=0.1).minimize(q.var("loss@SCALED"))
    for key, bad in [("decr_ratio", 0.99999999), ("incr_ratio", 1.00000001), ("incr_every_n_steps", 0)]:
        with pytest.raises(AmpError, match=rf"{key} must be .*got {re.escape(repr(bad))}"):
            unscale_grads(q, **{key: bad})


def test_fleet_amp_skips_a_step_with_inf_data_and_resumes_from_a_checkpoint(tmp_path):
    """fleet path end to end (Momentum): an inf in a batch skips the step; the scale and counters
    are persistables, so a run resumed from fleet.save_persistables continues bit for bit."""
    strategy = _strategy({"init_loss_scaling": 256.0, "incr_every_n_steps": 2, "decr_every_n_nan_or_inf": 1})
    main, opt, (ops, params_grads) = _train("mlp", strategy, optimizer=metaopt.optimizer.Momentum(0.1))
    assert opt.applied_meta_list == ["amp"]
    assert all(g.endswith("@UNSCALED") for _, g in params_grads)
    assert {op.type for op in ops} >= {"CheckFiniteAndUnscale", "UpdateLossScaling", "MomentumUpdate"}

    def feed(step):
        f = _feed("mlp", step)
        if step == 1:
            f["x"] = f["x"].clone()
            f["x"][0, 0] = float("inf")
        return f

    def steps(exe, rng):
        return [exe.run(main, feed=feed(s), fetch_list=[main.loss], return_numpy=False)[0] for s in rng]

    exe = metaopt.Executor("cpu")
    steps(exe, range(3))
    shrunk = float(np.float32(256.0) * np.float32(0.8))  # Fleet's default decr_ratio, in float32
    assert exe.scope["global_step"].item() == 2 and exe.scope["loss_scaling"].item() == shrunk
    fleet.save_persistables(exe, str(tmp_path), main)
    straight = steps(exe, range(3, 6))
    resumed = metaopt.Executor("cpu")
    fleet.load_persistables(resumed, str(tmp_path), main)
    assert resumed.scope["loss_scaling"].item() == shrunk
    again = steps(resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight, again, strict=True))
    for k in ("loss_scaling", "num_good_steps", "num_bad_steps", "global_step", "fc1.weight"):
        assert torch.equal(exe.scope[k], resumed.scope[k]), k


def test_static_loss_scaling_and_bf16_defaults():
    main, _, _ = _train("mlp", _strategy({"use_dynamic_loss_scaling": False, "init_loss_scaling": 8.0}))
    types = [op.type for op in main.ops]
    assert "CheckFiniteAndUnscale" in types and "UpdateLossScaling" not in types
    _, exe = _run(main, "mlp", 3)
    assert exe.scope["loss_scaling"].item() == 8.0
    bf16, _, _ = _train("mlp", _strategy({"dtype": "bfloat16"}))
    assert not {"CheckFiniteAndUnscale", "UpdateLossScaling", "Mul"} & {op.type for op in bf16.ops}
    assert "loss_scaling" not in bf16.vars
    assert any(op.type == "Cast" and op.attrs["to"] == 16 for op in bf16.ops)


# --- numerics ---------------------------------------------------------------------------------


@functools.cache
def _fp32_curve(name: str) -> list[float]:
    main = exported(name, dropout=0.0)[2].clone()
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(main.loss)
    return [float(x) for x in _run(main, name, 20)[0]]


@pytest.mark.parametrize(
    "configs",
    [
        {"dtype": "float16"},
        {"dtype": "bfloat16"},
        {"dtype": "float16", "use_pure_fp16": True, "use_fp16_guard": False},
        {"dtype": "bfloat16", "use_pure_fp16": True, "use_fp16_guard": False},
    ],
    ids=["fp16", "bf16", "fp16-O2", "bf16-O2"],
)
@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_loss_curve_tracks_float32(name, configs):
    """20 Adam steps (lr 1e-3): every loss within 1e-2 relative of float32's (the issue's bar;
    measured on tiny bert/gpt: <= 7.5e-5 for float16, <= 1.9e-4 for bfloat16, O1 and O2)."""
    main, _, _ = _train(name, _strategy(configs))
    ref = _fp32_curve(name)
    losses, exe = _run(main, name, 20)
    dev = [abs(float(a) - b) / abs(b) for a, b in zip(losses, ref, strict=True)]
    assert max(dev) <= 1e-2, dev
    assert max(dev) > 0  # the matmuls really ran in low precision
    low = configs["dtype"]
    if configs.get("use_pure_fp16"):
        assert {exe.scope[v.name].dtype for v in main.params()} == {getattr(torch, low)}
        masters = [n for n, v in main.vars.items() if v.kind == "opt_state" and n.endswith("@MASTER")]
        assert len(masters) == len(main.params()) and all(main.vars[m].dtype == "float32" for m in masters)
    else:
        assert all(exe.scope[v.name].dtype == torch.float32 for v in main.params())
    if low == "float16":  # no overflow on these: every step was applied
        assert exe.scope["global_step"].item() == 20 and exe.scope["num_bad_steps"].item() == 0


CHECKPOINTS = {"bert": ["bert.encoder.layer.*"], "gpt": ["transformer.h.*"], "mlp": ["fc1", "fc2"]}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_amp_recompute_and_offload_bit_identical_to_amp_alone(name, dtype):
    """Dropout 0.1: the recomputed casts and masks replay exactly; offloaded checkpoints move in
    the low dtype (half the bytes of float32 ones)."""
    plain, _, _ = _train(name, _strategy({"dtype": dtype}), dropout=0.1)
    rc, _, _ = _train(name, _strategy({"dtype": dtype}, CHECKPOINTS[name]), dropout=0.1)
    off, _, _ = _train(name, _strategy({"dtype": dtype}, CHECKPOINTS[name], offload=True), dropout=0.1)
    assert any(op.type == "Cast" and op.role == "recompute" for op in rc.ops)  # casts recomputed too
    ref_losses, ref_exe = _run(plain, name, 5, seed=3)
    for program in (rc, off):
        losses, exe = _run(program, name, 5, seed=3)
        assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
        assert ref_exe.scope.keys() == exe.scope.keys()
        assert all(torch.equal(ref_exe.scope[k], exe.scope[k]) for k in ref_exe.scope)
    fp32 = exported(name, dropout=0.1)[2].clone()
    s = fleet.DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": CHECKPOINTS[name], "enable_offload": True}
    fleet.distributed_optimizer(metaopt.optimizer.Adam(learning_rate=1e-3), s).minimize(fp32.loss)
    _, fp32_exe = _run(fp32, name, 1)
    _, off_exe = _run(off, name, 1)
    assert off_exe.memory_stats()["offloaded_bytes"] * 2 == fp32_exe.memory_stats()["offloaded_bytes"] > 0


@pytest.mark.filterwarnings("ignore:recompute with checkpoints")
def test_amp_recompute_golden(golden):
    """amp (float16, dynamic scaling) + recompute on mlp: the casts (recomputed with their
    segment), the scaled loss, the fused check, Fleet's scale update and the skippable updates."""
    main, _, _ = _train(
        "mlp", _strategy({}, CHECKPOINTS["mlp"]), dropout=0.1, optimizer=metaopt.optimizer.SGD(0.1)
    )
    text = str(main)
    golden("amp/mlp", text)
    assert str(parse_program(text)) == text


# --- configuration errors ---------------------------------------------------------------------


def test_config_errors_leave_the_program_untouched():
    fleet.init(is_collective=True)
    main = exported("mlp")[2].clone()
    before = str(main)
    for configs, match in [
        ({"custom_white_list": ["Matmul"]}, r"list'\]: unknown op type 'Matmul' \(did you mean 'MatMul'"),
        ({"custom_black_list": ["softmax"]}, r"unknown op type 'softmax' \(did you mean 'Softmax'"),
        ({"custom_white_list": ["Gemm"], "custom_black_list": ["Gemm"]}, r"'Gemm' is in both"),
        ({"use_pure_fp16": True}, r"use_fp16_guard=True .* set amp_configs\['use_fp16_guard'\] = False"),
    ]:  # fmt: skip
        opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), _strategy(configs))
        with pytest.raises(AmpError, match=match):
            opt.minimize(main.loss)
        assert str(main) == before
    with pytest.raises(ValueError, match=r"dtype.*float61"):
        _strategy({"dtype": "float61"})


def test_a_worker_gpu_without_support_is_refused_at_minimize(monkeypatch):
    from metaopt.ops.kernels import amp as amp_kernels
    from metaopt.ops.kernels.amp import AmpDeviceError

    fleet.init(is_collective=True)
    main = exported("mlp")[2].clone()
    before = str(main)
    monkeypatch.setattr(amp_kernels, "_SUPPORTED", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), _strategy({"dtype": "bfloat16"}))
    with pytest.raises(AmpDeviceError, match=r"cuda:0 \(Tesla T4, compute capability 7.5\) has no bfloat16"):
        opt.minimize(main.loss)
    assert str(main) == before


@pytest.mark.parametrize(
    "configs", [{}, {"dtype": "bfloat16", "use_pure_fp16": True, "use_fp16_guard": False}]
)
def test_amp_training_program_survives_onnx_save_and_load(tmp_path, configs):
    """Everything but the device check (a forward op nothing reads: the importer's dead-code
    removal drops it) comes back: casts, scaling ops, skip inputs, master weights, updates."""
    from metaopt.frontend import onnx_save

    main, _, _ = _train("bert", _strategy(configs), dropout=0.1)
    onnx_save.save(main, tmp_path / "amp.onnx")
    back = metaopt.load(tmp_path / "amp.onnx")

    def fields(p):
        vars_ = {
            n: (v.dtype, v.shape, v.kind, v.trainable) for n, v in p.vars.items() if n != "amp_device_ok"
        }
        ops = [line for line in str(p)[str(p).index("ops:") :].splitlines() if "CheckAmpDevice" not in line]
        return vars_, ops, p.updates, p.modules, p.inputs, p.outputs, p.loss_name

    assert fields(back) == fields(main)
    assert [op.type for op in main.ops[:1]] == ["CheckAmpDevice"]


def test_amp_optimizer_takes_loss_scaling_for_bf16():
    fleet.init(is_collective=True)
    main = exported("mlp")[2].clone()
    opt = fleet.distributed_optimizer(metaopt.optimizer.SGD(0.1), _strategy({"dtype": "bfloat16"}))
    opt.loss_scaling = True
    opt.minimize(main.loss)
    assert any(op.type == "CheckFiniteAndUnscale" for op in main.ops)
    losses, exe = _run(main, "mlp", 2)
    assert exe.scope["num_good_steps"].item() == 2 and all(torch.isfinite(x) for x in losses)


# --- data parallel: every rank skips the same step --------------------------------------------


def _two_workers(script: str, out: Path, *args: str) -> list:
    procs = start_workers(2, [str(HERE / script), str(out), *args])
    wait_workers(procs, script, 180)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_data_parallel_ranks_skip_the_same_step(tmp_path):
    """Only rank 1's batch overflows at step 2; the check reads the all-reduced grads, so both
    ranks skip that step, shrink the scale alike and stay identical."""
    traces = _two_workers("amp_dp_worker.py", tmp_path)
    for a, b in zip(*traces, strict=True):
        assert a["loss_scaling"] == b["loss_scaling"] and a["global_step"] == b["global_step"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert [t["global_step"] for t in traces[0]] == [1, 2, 2, 3, 4]
    assert [t["loss_scaling"] for t in traces[0]][1:3] == [1024.0, 512.0]
    assert all(
        torch.equal(traces[0][1]["params"][k], traces[0][2]["params"][k]) for k in traces[0][1]["params"]
    )


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1", "ZBV"])
def test_pipeline_stages_skip_the_same_step(tmp_path, schedule):
    """Only stage 0's grads overflow at step 2 (stage 1's are finite): the stages sum their
    flags, so both skip that step (params untouched on both), halve the scale alike and go on.
    With ZB-H1 and ZB-V the check waits for the last W (it runs in the update phase); ZB-V's
    worker 0 holds the first and the last chunk (fc1, fc3)."""
    traces = _two_workers("amp_pp_worker.py", tmp_path, schedule)
    for stage in traces:
        assert [t["global_step"] for t in stage] == [1, 2, 2, 3, 4]
        assert [t["loss_scaling"] for t in stage] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
        one, two, three = (stage[k]["params"] for k in (1, 2, 3))
        assert all(torch.equal(one[k], two[k]) for k in one)  # the skipped step changed nothing
        assert all(not torch.equal(two[k], three[k]) for k in two)  # the next one updated every param
    first = {"fc1.weight", "fc1.bias"} | ({"fc3.weight", "fc3.bias"} if schedule == "ZBV" else set())
    assert set(traces[0][0]["params"]) == first  # each stage has its own params

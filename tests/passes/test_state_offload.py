"""passes/state_offload.py: ZeRO-Offload's optimizer state in host memory between steps (Fleet's
sharding_configs["optimize_offload"]). The rewrite as text, training bit-identical to the state
kept on the device, the bytes moved from the device account to the host account (measured =
`estimate_memory`), an AMP-skipped step keeping the old state, and its refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import names, parse_program, print_program, verify
from metaopt.passes.memory_estimate import estimate_memory
from metaopt.passes.state_offload import StateOffloadError, plan_state_offload, state_offload


def _trained(optimizer=None) -> metaopt.Program:
    p = exported("mlp")[2].clone()
    (optimizer or metaopt.optimizer.Adam(learning_rate=1e-2)).minimize(p.loss)
    return p


def _states(p: metaopt.Program) -> list[str]:
    return [v.name for v in p.vars.values() if v.kind == "opt_state" and v.shape]


def _train(prog: metaopt.Program, steps: int = 3) -> tuple[dict, dict]:
    mod = programs.get("mlp")
    exe = metaopt.Executor("cpu")
    for s in range(steps):
        feed = dict(zip(mod.INPUT_NAMES, mod.example_inputs("tiny", 4, seed=s), strict=True))
        exe.run(prog, feed=feed, fetch_list=[prog.loss])
    held = {
        v.name: exe.scope[v.name].clone() for v in prog.vars.values() if v.persistable and v.name in exe.scope
    }
    return held, exe.memory_stats()


def test_the_rewrite_reads_as_its_golden_and_parses_back(golden):
    q = state_offload(_trained(), bucket_bytes=4096)
    verify(q)
    text = print_program(q)
    golden("state_offload/mlp_adam", text)
    assert print_program(parse_program(text)) == text
    assert all(q.vars[s].host for s in _states(q))
    plan = plan_state_offload(_trained(), bucket_bytes=4096)
    assert len(plan.buckets) == 4 and "12 state tensors, 13,856 bytes held in host memory" in str(plan)


def test_training_is_bit_identical_and_the_state_moves_to_the_host_account():
    p = _trained()
    q = state_offload(p, bucket_bytes=0)
    plain, on_device = _train(p)
    offloaded, on_host = _train(q)
    assert plain.keys() == offloaded.keys()
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
    state = sum(p.vars[s].nbytes({}) for s in _states(p))
    assert on_device["persistable_bytes"] - on_host["persistable_bytes"] == state
    assert on_host["host_persistable_bytes"] == state and on_device["host_persistable_bytes"] == 0
    est = estimate_memory(q, dims={"batch": 4})
    assert est.persistable_bytes == on_host["persistable_bytes"] and est.peak_bytes == on_host["peak_bytes"]
    # at most one bucket of state on the device at once (bucket_bytes=0: one update's)
    assert on_host["peak_bytes"] < on_device["peak_bytes"]


def test_the_memory_report_says_the_state_is_in_host_memory():
    from metaopt.report.memory_picture import persistable_breakdown

    assert "host memory" not in persistable_breakdown(_trained())
    assert "optimizer state 13.5 KiB in host memory" in persistable_breakdown(state_offload(_trained()))


def test_nothing_to_do_for_updates_without_state():
    p = _trained(metaopt.optimizer.SGD(learning_rate=0.1))
    plan = plan_state_offload(p)
    assert plan.buckets == [] and len(plan.skipped) == 6 and "no optimizer state" in plan.skipped[0]
    assert print_program(state_offload(p)) == print_program(p)


def test_refusals_name_what_is_at_fault():
    q = state_offload(_trained())
    with pytest.raises(StateOffloadError, match=r"'fc1.weight@MOMENT1' is in host memory already"):
        plan_state_offload(q)
    with pytest.raises(StateOffloadError, match="bucket_bytes must be >= 0"):
        plan_state_offload(_trained(), bucket_bytes=-1)
    with pytest.raises(ValueError, match=r"var 'x': only a persistable is held in host memory"):
        metaopt.Var("x", "float32", (2,), "activation", host=True)


def _fleet(offload: bool, amp: bool) -> tuple[dict, list[str]]:
    """One worker (sharding_degree 1) through fleet; AMP float16 with a loss scale that overflows
    on the first step, which every update then skips, and fits on the second."""
    fleet.init(is_collective=True)
    main = exported("mlp")[2].clone()
    s = fleet.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"sharding_degree": 1, "optimize_offload": offload, "segment_broadcast_MB": 0.001}
    if amp:
        s.amp = True
        # 2**40 overflows float16 on step 1, which is skipped; then the scale is ~1.1
        s.amp_configs = {"init_loss_scaling": 2.0**40, "decr_every_n_nan_or_inf": 1, "decr_ratio": 1e-12}
    opt = fleet.distributed_optimizer(metaopt.optimizer.Momentum(learning_rate=0.1, momentum=0.9), s)
    opt.minimize(main.loss)
    held, _ = _train(main, steps=2)
    return held, opt.applied_meta_list


@pytest.mark.parametrize("amp", [False, True])
def test_through_fleet_bit_identical_with_and_without_amp_skipping_a_step(amp):
    plain, applied = _fleet(False, amp)
    offloaded, _ = _fleet(True, amp)
    assert "sharding" in applied
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
    if amp:  # the first step overflowed and was skipped (state kept), the second updated it
        assert float(offloaded[names.loss_scaling()]) < 2.0**40  # the overflow was seen
        assert any(bool(t.any()) for k, t in offloaded.items() if "VELOCITY" in k)


def test_host_state_survives_onnx_save_and_load(tmp_path):
    from metaopt.frontend.onnx_save import save

    q = state_offload(_trained())
    save(q, tmp_path / "q.onnx")
    back = metaopt.load(tmp_path / "q.onnx")
    assert {n for n, v in back.vars.items() if v.host} == set(_states(q))

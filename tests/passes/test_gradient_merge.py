"""Gradient merge (strategy.gradient_merge) on the step driver: k runs of b samples update
like one run of k x b; the update phase runs on every k-th run only; composes with AMP's
skip-on-overflow and with recompute. (Two gloo workers: tests/training/test_data_parallel.py,
case "merge": one all-reduce per k runs, equal to one process on the full batch.)"""

from __future__ import annotations

import pytest
import torch
from conftest import exported

import metaopt
import programs
from metaopt import fleet
from metaopt.ir import parse_program, verify
from metaopt.passes.gradient_merge import GradientMergeError, gradient_merge

K = 4


def _strategy(k: int = K, avg: bool = True, **flags) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": k, "avg": avg}
    for key, value in flags.items():
        setattr(s, key, value)
    return s


def _trained(name: str, strategy, optimizer=None, dropout: float = 0.0):
    fleet.init(is_collective=True)
    main = exported(name, dropout=dropout)[2].clone()
    opt = fleet.distributed_optimizer(optimizer or metaopt.optimizer.SGD(0.1), strategy)
    opt.minimize(main.loss)
    verify(main)
    return main, opt


def _batch(name: str, n: int, seed: int) -> list[torch.Tensor]:
    return list(programs.get(name).example_inputs("tiny", n, seed=seed))


def _feed(name: str, xs) -> dict:
    return dict(zip(programs.get(name).INPUT_NAMES, xs, strict=True))


def _params(exe, p) -> dict[str, torch.Tensor]:
    return {v.name: exe.scope[v.name].clone() for v in p.params()}


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_k_runs_update_like_one_run_on_k_times_the_batch(name):
    """SGD over two windows: params after each window equal one full-batch SGD step (rtol
    1e-5: the mean of k partial means and one mean over k x b round differently)."""
    merged, _ = _trained(name, _strategy())
    plain, _ = _trained(name, fleet.DistributedStrategy())
    exe_m, exe_p = metaopt.Executor("cpu"), metaopt.Executor("cpu")
    per_run = 2
    for window in range(2):
        full = _batch(name, K * per_run, seed=window)
        if name == "bert":  # MLM targets: the same count in every micro-batch (mean over targets)
            ids, tt, mask, _, nsp = full
            first = (torch.arange(ids.shape[1]) >= 1) & (torch.arange(ids.shape[1]) <= 3)
            full = [ids, tt, mask, torch.where(first.expand_as(ids), ids, torch.full_like(ids, -100)), nsp]
        start = _params(exe_m, merged) if window else None
        for j in range(K):
            part = [x[j * per_run : (j + 1) * per_run] for x in full]
            exe_m.run(merged, feed=_feed(name, part), fetch_list=[merged.loss])
            if window and j < K - 1:  # mid-window: nothing updated yet
                assert all(torch.equal(start[k], v) for k, v in _params(exe_m, merged).items())
        exe_p.run(plain, feed=_feed(name, full), fetch_list=[plain.loss])
        got, want = _params(exe_m, merged), _params(exe_p, plain)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert int(exe_m.scope["gradient_merge_step"]) == 0  # two whole windows
    assert int(exe_m.scope["global_step"]) == 2 == int(exe_p.scope["global_step"])


def test_sum_instead_of_mean_with_avg_false():
    """avg=False: the merged grad is the sum of the k runs' grads (k times the mean)."""
    merged, _ = _trained("mlp", _strategy(k=2, avg=False))
    plain, _ = _trained("mlp", fleet.DistributedStrategy(), optimizer=metaopt.optimizer.SGD(0.2))
    exe_m, exe_p = metaopt.Executor("cpu"), metaopt.Executor("cpu")
    full = _batch("mlp", 4, seed=3)
    for j in range(2):
        exe_m.run(merged, feed=_feed("mlp", [x[2 * j : 2 * j + 2] for x in full]), fetch_list=[])
    exe_p.run(plain, feed=_feed("mlp", full), fetch_list=[])
    for k, want in _params(exe_p, plain).items():  # lr 0.1 x sum of 2 means = lr 0.2 x mean
        torch.testing.assert_close(_params(exe_m, merged)[k], want, rtol=1e-5, atol=1e-6, msg=k)


def test_the_program_shows_the_merge_and_round_trips(golden, tmp_path):
    main, opt = _trained("mlp", _strategy())
    text = str(main)
    golden("gradient_merge/mlp_sgd", text)
    assert "gradient_merge: k_steps=4 avg=1 step=gradient_merge_step" in text
    assert str(parse_program(text)) == text
    merges = [op for op in main.ops if op.type == "GradMerge"]
    updates = [op for op in main.ops if op.type == "SGDUpdate"]
    assert len(merges) == len(updates) == 6
    assert {op.inputs[1] for op in updates} == {op.outputs[0] for op in merges}  # updates read merged grads
    from metaopt.frontend import onnx_save

    onnx_save.save(main, tmp_path / "gm.onnx")
    assert metaopt.load(tmp_path / "gm.onnx").gradient_merge == main.gradient_merge
    # fuse_linear_ce is on by default (the mlp has no cross-entropy head: it changes nothing)
    assert opt.plan().steps == ["fuse_linear_ce", "append_backward", "apply_optimizer", "gradient_merge"]


def test_fetching_an_update_output_mid_window_is_refused_by_name():
    main, _ = _trained("mlp", _strategy(k=2))
    exe = metaopt.Executor("cpu")
    new_step = next(op.outputs[0] for op in main.ops if op.type == "StepCounter")
    feed = _feed("mlp", _batch("mlp", 2, seed=0))
    with pytest.raises(ValueError, match=rf"fetch '{new_step}' is made by the update phase.*every 2-th run"):
        exe.run(main, feed=feed, fetch_list=[new_step])
    exe.run(main, feed=feed, fetch_list=[])
    (step,) = exe.run(main, feed=feed, fetch_list=[new_step])  # the second run updates
    assert int(step) == 1


def test_a_window_of_a_thousand_runs_without_an_update_is_named(caplog):
    """k_steps=10**9 was accepted and params never changed, silently: it is refused now
    (strategy.MAX_K_STEPS, tests/fleet/test_strategy.py), and a long window allowed is still
    warned at 1000, 10000, ... runs (the scope's counter: set here, not run 999x)."""
    import logging

    from metaopt.fleet.strategy import MAX_K_STEPS
    from metaopt.runtime.executor import MERGE_WARN_RUNS

    main, _ = _trained("mlp", _strategy(k=MAX_K_STEPS))
    exe = metaopt.Executor("cpu")
    feed = _feed("mlp", _batch("mlp", 2, seed=0))
    exe.run(main, feed=feed, fetch_list=[])
    before = _params(exe, main)
    with caplog.at_level(logging.WARNING, logger="metaopt"):
        exe.run(main, feed=feed, fetch_list=[])  # run 2: quiet
        assert not caplog.records
        exe.scope["gradient_merge_step"].fill_(MERGE_WARN_RUNS - 1)
        exe.run(main, feed=feed, fetch_list=[])  # run 1000 of the window
        exe.run(main, feed=feed, fetch_list=[])  # 1001: quiet again
    [record] = caplog.records
    assert f"1000 runs under gradient merge without an update (k_steps={MAX_K_STEPS}" in record.getMessage()
    after = _params(exe, main)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_recompute_under_gradient_merge_is_bit_identical():
    base, _ = _trained("bert", _strategy(k=2), optimizer=metaopt.optimizer.Adam(1e-3), dropout=0.1)
    rc_strategy = _strategy(k=2, recompute=True)
    rc_strategy.recompute_configs = {"checkpoints": ["bert.encoder.layer.*"], "enable_offload": True}
    rc, _ = _trained("bert", rc_strategy, optimizer=metaopt.optimizer.Adam(1e-3), dropout=0.1)
    assert any(op.role == "recompute" for op in rc.ops) and any(op.role == "offload" for op in rc.ops)
    results = []
    for p in (base, rc):
        exe = metaopt.Executor("cpu")
        metaopt.seed(7)
        losses = [
            exe.run(p, feed=_feed("bert", _batch("bert", 2, seed=s)), fetch_list=[p.loss])[0]
            for s in range(4)
        ]
        results.append((losses, _params(exe, p)))
    (l0, p0), (l1, p1) = results
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(l0, l1, strict=True))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


def test_amp_overflow_in_any_run_of_the_window_skips_the_merged_update():
    s = _strategy(k=2, amp=True)
    s.amp_configs = {
        "dtype": "float16",
        "init_loss_scaling": 1024.0,
        "decr_every_n_nan_or_inf": 1,
        "decr_ratio": 0.5,
    }
    main, opt = _trained("mlp", s)
    assert opt.plan().steps == [
        "fuse_linear_ce",
        "amp_casts",
        "scale_loss",
        "append_backward",
        "apply_optimizer",
        "gradient_merge",
        "unscale_grads",
    ]
    exe = metaopt.Executor("cpu")
    good = _batch("mlp", 2, seed=0)
    bad = [x.clone() for x in good]
    bad[0][0, 0] = float("inf")
    exe.run(main, feed=_feed("mlp", good), fetch_list=[])
    start = _params(exe, main)
    exe.run(main, feed=_feed("mlp", bad), fetch_list=[])  # overflow in the window's 2nd run
    assert all(torch.equal(start[k], v) for k, v in _params(exe, main).items())  # skipped
    assert float(exe.scope["loss_scaling"]) == 512.0  # one overflowed update: scaled by decr_ratio
    for _ in range(2):  # the next window is clean: it updates
        exe.run(main, feed=_feed("mlp", good), fetch_list=[])
    assert any(not torch.equal(start[k], v) for k, v in _params(exe, main).items())


def test_bad_input():
    main = exported("mlp")[2].clone()
    with pytest.raises(GradientMergeError, match="no update ops reading grads"):
        gradient_merge(main, k_steps=2, loss_grad=None)
    metaopt.optimizer.SGD(0.1).minimize(main.loss)
    with pytest.raises(GradientMergeError, match="k_steps must be an int >= 1, got 0"):
        gradient_merge(main, k_steps=0, loss_grad=None)
    with pytest.raises(GradientMergeError, match="avg=True: the loss grad None"):
        gradient_merge(main, k_steps=2, loss_grad=None)
    once = gradient_merge(main, k_steps=2, avg=False, loss_grad=None)
    with pytest.raises(GradientMergeError, match="gradient_merge runs once"):
        gradient_merge(once, k_steps=2, avg=False, loss_grad=None)
    assert str(gradient_merge(main, k_steps=1, loss_grad=None)) == str(main)  # k=1: nothing to do

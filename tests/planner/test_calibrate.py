"""The planner's time model and its calibration (metaopt/planner/calibrate.py, issue 45): the fit
recovers the rates that made the times, the executor times each op of a step, the rates round-trip
through a file, and fleet.plan prices a step as the module says (its per-op cost, FLOPs and bytes,
summed over the worker's ops). The links' measurement runs on 2 gloo workers in test_search.py."""

from __future__ import annotations

import math

import pytest
import torch

import metaopt
from metaopt import fleet
from metaopt.ir import roles
from metaopt.planner import calibrate as cal
from metaopt.planner.search import PlanError


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


@pytest.fixture(scope="module")
def forward():
    torch.manual_seed(0)
    return metaopt.export(_Mlp(), (torch.randn(8, 32), torch.randint(0, 8, (8,))))


def _feed(batch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(batch, 32, generator=g), "y": torch.randint(0, 8, (batch,), generator=g)}


def test_the_fit_recovers_the_rates_that_made_the_times():
    """Times made exactly as 20 us + FLOPs / 50 GFLOP/s + bytes / 5 GB/s: the fit gives those
    three back (to 1e-9 relative: float64 least squares on exact data)."""
    rows = [(f, b) for f in (0.0, 1e6, 3e7, 2e8) for b in (1e3, 4e5, 9e6)]
    samples = [(f, b, 20e-6 + f / 50e9 + b / 5e9) for f, b in rows]
    c, flops, bps = cal.fit_compute(samples)
    assert c == pytest.approx(20e-6, rel=1e-9)
    assert flops == pytest.approx(50e9, rel=1e-9)
    assert bps == pytest.approx(5e9, rel=1e-9)


def test_ops_that_cost_nothing_by_the_model_measure_the_per_op_cost():
    """Views and bookkeeping (no FLOPs, no bytes) take the dispatch alone: the per-op cost is their
    median, and the rates fit the other ops' time beyond it (to 1e-9: exact data)."""
    free = [(0.0, 0.0, t) for t in (9e-6, 10e-6, 30e-6)]
    rest = [(f, b, 10e-6 + f / 80e9 + b / 8e9) for f in (1e6, 5e7, 3e8) for b in (1e4, 2e6, 5e7)]
    c, flops, bps = cal.fit_compute(free + rest)
    assert c == 10e-6
    assert flops == pytest.approx(80e9, rel=1e-9) and bps == pytest.approx(8e9, rel=1e-9)


def test_a_term_the_times_do_not_grow_with_costs_nothing():
    """Times that fall as bytes grow would fit a negative rate: the fit leaves that term out (an
    infinite rate) and keeps the others non-negative."""
    samples = [(f, b, 1e-5 + f / 1e10 - b * 1e-13) for f in (1e6, 1e7, 1e8) for b in (1e3, 1e6, 1e7)]
    c, flops, bps = cal.fit_compute(samples)
    assert c >= 0 and flops > 0 and bps == math.inf
    with pytest.raises(ValueError, match="no timed ops"):
        cal.fit_compute([])


def test_the_executor_times_each_op_of_the_step(forward):
    """`time_ops`: one positive time per op of the step (startup ops, which run once, left out),
    in program order; an executor that does not record refuses `op_seconds` by its flag."""
    p = forward.clone()
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(p.loss)
    timed = cal.time_ops(metaopt.Executor("cpu", record_op_times=True), p, _feed(8), runs=2)
    body = [op for op in p.ops if not roles.is_startup(op.role)]
    assert [op for op, _ in timed] == body
    assert all(s > 0 for _, s in timed)
    with pytest.raises(ValueError, match="record_op_times=True"):
        metaopt.Executor("cpu").op_seconds()


def test_rates_round_trip_through_a_file_and_refuse_unknown_fields(tmp_path):
    rates = cal.Rates(2e9, 3e9, 4e-5, 5e8, 6e-5, measured="a test")
    rates.save(tmp_path / "r.json")
    assert cal.Rates.load(tmp_path / "r.json") == rates
    (tmp_path / "bad.json").write_text('{"device_flop": 1}')
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['device_flop'\]"):
        cal.Rates.load(tmp_path / "bad.json")


def test_the_plan_prices_a_step_as_the_model_says(forward):
    """One device, one layout: its predicted step is, op by op of the minimized program, the per-op
    cost plus FLOPs and bytes at the rates; measured rates are taken as given."""
    rates = cal.Rates(1e9, 2e9, 3e-5, 1e9, 1e-5)
    plans = fleet.plan(
        forward, devices=1, memory_per_device="1GiB", global_batch=8, optimizer=None, rates=rates
    )
    none = next(p for p in plans if p.layout.recompute == "none")
    p = forward.clone()
    metaopt.optimizer.Adam(learning_rate=1e-3).minimize(p.loss)
    from metaopt.ops import registry

    want = 0.0
    for op in p.ops:  # a view too: its dispatch (op_cost gives it no FLOPs and no bytes)
        flops, moved = cal.op_cost(p, op, {"batch": 8})
        want += 3e-5 + flops / 1e9 + moved / 2e9
    assert any(registry.get(op.type) is not None and registry.get(op.type).view for op in p.ops)
    assert none.step_seconds == pytest.approx(want, rel=1e-12)
    with pytest.raises(PlanError, match="rates must be a metaopt.planner.calibrate.Rates, got dict"):
        fleet.plan(forward, devices=1, memory_per_device="1GiB", global_batch=8, rates={"op_seconds": 1})
